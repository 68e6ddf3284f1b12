package pull

import (
	"encoding/json"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/kvhost/kvhost/host/plugin"
	"github.com/kvhost/kvhost/host/wire/vllm"
	"github.com/kvhost/kvhost/planner"
)

// FuzzSenderNotification feeds arbitrary notification bytes (from any
// peer, on any rank) to the prefill's bookkeeping: no panic, every
// notification counted exactly once, a release only for a held request;
// what is kept for requests not held yet is accounted to the byte, and a
// hold of such a request takes all of it.
func FuzzSenderNotification(f *testing.F) {
	for _, s := range []string{"a:2", "a:1", "b:c:1", "b:c:2", "zzz:3", ":1", "a:", "a:0", "a:-1", "a:99999999999",
		"\xff:1", "", "a:2:2", "a:02", "HB:a,b:c", "HB:", "HB:\xff", "a:4"} {
		f.Add(uint8(0), []byte(s), false)
		f.Add(uint8(1), []byte(s), true)
	}
	f.Fuzz(func(t *testing.T, rank uint8, msg []byte, v6 bool) {
		gen := vllm.G2
		if v6 {
			gen, _ = vllm.Lookup(6)
		}
		s := &Sender{log: slog.New(slog.NewTextHandler(discard{}, nil)), obs: NopObserver{}, held: map[string]*heldReq{},
			early: map[string]*earlyReq{}, earlyMax: 4, earlyMaxBytes: 4 << 10, ranks: []senderRank{{tpRank: 0}, {tpRank: 1}}, gen: gen, cfg: SenderConfig{TPSize: 2}, extend: time.Second}
		hold := func(id string) {
			s.seq++
			s.held[id] = newHeldReq(s.seq, []int32{1}, time.Now(), 2)
			s.counts.Held++
		}
		hold("a")
		hold("b:c")
		now := time.Now()
		for i := 0; i < 3; i++ {
			before := s.counts
			_, wasHeld := s.held[string(msg[:max(0, strings.LastIndexByte(string(msg), ':'))])]
			rel, ok := s.applyLocked(int(rank)%2, plugin.Notif{From: "peer", Msg: msg}, now)
			c := s.counts
			if c.Notifications != before.Notifications+1 {
				t.Fatalf("notification counted %d times", c.Notifications-before.Notifications)
			}
			bad := (c.UnknownNotifications - before.UnknownNotifications) + (c.MalformedNotifications - before.MalformedNotifications)
			if bad > 1 || ok && bad != 0 {
				t.Fatalf("counts %+v -> %+v, released %v", before, c, ok)
			}
			if ok && (!wasHeld || rel.Reason != ReleaseNotified || s.held[rel.RequestID] != nil || c.Held != before.Held-1) {
				t.Fatalf("release %+v of a request held %v; counts %+v", rel, wasHeld, c)
			}
			if c.Held != len(s.held) {
				t.Fatalf("held count %d, map %d", c.Held, len(s.held))
			}
			if c.Heartbeats != before.Heartbeats && (!v6 || ok || bad != 0) {
				t.Fatalf("a heartbeat in version %d: counts %+v -> %+v", gen.Version, before, c)
			}
			if kept := c.EarlyKept - before.EarlyKept; kept != 0 && (kept != 1 || wasHeld || c.UnknownNotifications != before.UnknownNotifications+1) {
				t.Fatalf("kept early %d, held %v: counts %+v -> %+v", kept, wasHeld, before, c)
			}
		}
		bytes, kept := 0, 0
		for id, e := range s.early {
			sum := len(id)
			for _, n := range e.notifs {
				sum += len(n.from) + earlyNotifOverhead
			}
			if sum != e.bytes || len(e.notifs) > 2 {
				t.Fatalf("early %q: %d bytes counted, %d kept; %d notifications from one peer", id, e.bytes, sum, len(e.notifs))
			}
			bytes += e.bytes
			kept += len(e.notifs)
		}
		if bytes != s.earlyBytes || kept != s.counts.EarlyKept {
			t.Fatalf("early bytes %d, counted %d; kept %d, counted %d", bytes, s.earlyBytes, kept, s.counts.EarlyKept)
		}
		for id := range s.early {
			h := newHeldReq(99, []int32{1}, now, 2)
			s.takeEarlyLocked(id, h)
			if h.notified == 0 {
				t.Fatalf("a hold of %q took none of its early notifications", id)
			}
		}
		if len(s.early) != 0 || s.earlyBytes != 0 || s.counts.EarlyApplied != kept {
			t.Fatalf("after the holds: %d early, %d bytes, %d applied of %d", len(s.early), s.earlyBytes, s.counts.EarlyApplied, kept)
		}
	})
}

// fuzzLocal is the decode side the geometry fuzzers handshake as.
var fuzzLocal = planner.VLLMDecode{
	Agent: planner.VLLMAgent{BaseAddrs: []uint64{1 << 20, 2 << 20, 3 << 20, 4 << 20}, BlockLens: []uint64{512, 512, 512, 512},
		NumBlocks: 64, BlockSize: 16, KVCacheLayout: LayoutHND, Kind: planner.DRAM},
	TPRank: 1, TPSize: 2, TotalKVHeads: 4,
}

// FuzzHandshakeGeometry decodes arbitrary agent metadata bytes and takes
// them through the geometry step of a handshake: no panic, and an accepted
// peer's lists are consistent and within the descriptor bound.
func FuzzHandshakeGeometry(f *testing.F) {
	good := &vllm.AgentMetadata{EngineID: "p", AgentMetadata: []byte("blob"), KVCachesBaseAddr: []uint64{1 << 30, 2 << 30, 3 << 30, 4 << 30},
		BlockLens: []int{512, 512, 512, 512}, NumBlocks: 80, KVCacheLayout: LayoutHND, BlockSize: 16}
	f.Add(good.Encode(), uint8(1))
	good.BlockSize, good.BlockLens = 8, []int{256, 256, 256, 256}
	f.Add(good.Encode(), uint8(1))
	good.NumBlocks = 1 << 30
	f.Add(good.Encode(), uint8(2))
	f.Add([]byte{0x80}, uint8(1))
	f.Fuzz(func(t *testing.T, b []byte, tp uint8) {
		md, err := vllm.DecodeAgentMetadata(b)
		if err != nil {
			return
		}
		remote, err := remoteAgent(md, 0)
		if err != nil {
			return
		}
		r, err := planner.NewVLLMReader(fuzzLocal, remote, int(tp))
		if err != nil {
			return
		}
		rl, ll := r.RemoteList(), r.LocalList()
		if rl.Len() <= 0 || ll.Len() <= 0 {
			t.Fatalf("accepted with empty lists: %d, %d", rl.Len(), ll.Len())
		}
		if rl.Len() <= 1<<16 {
			if n := len(xferDescs(&rl)); n != rl.Len() {
				t.Fatalf("%d descriptors for a list of %d", n, rl.Len())
			}
		}
	})
}

// FuzzLoadParams takes arbitrary kv_transfer_params JSON (what the proxy
// forwards from the prefill) through the checks and the per-request
// planning of a Load: no panic, and accepted reads pair ids one to one
// inside both lists.
func FuzzLoadParams(f *testing.F) {
	remote := planner.VLLMAgent{BaseAddrs: []uint64{1 << 30, 2 << 30, 3 << 30, 4 << 30}, BlockLens: []uint64{512, 512, 512, 512},
		NumBlocks: 80, BlockSize: 8, KVCacheLayout: LayoutHND, Kind: planner.DRAM}
	local := fuzzLocal
	local.Agent.BlockLens = []uint64{1024, 1024, 1024, 1024} // 2x prefill's block size
	local.TPSize, local.TPRank = 1, 0
	r, err := planner.NewVLLMReader(local, remote, 1)
	if err != nil {
		f.Fatal(err)
	}
	ll, rl := r.LocalList(), r.RemoteList()
	f.Add(`{"do_remote_prefill":true,"remote_block_ids":[1,2,3],"remote_engine_id":"e","remote_request_id":"r","remote_host":"h","remote_port":1}`, []byte{4, 7})
	f.Add(`{"do_remote_prefill":true,"remote_block_ids":[79,0,5,6,7],"remote_engine_id":"e","remote_request_id":"r","remote_host":"h","remote_port":1,"tp_size":1}`, []byte{1})
	f.Add(`{"do_remote_prefill":true,"remote_block_ids":[2147483647],"remote_engine_id":"e","remote_request_id":"r","remote_host":"h","remote_port":1}`, []byte{})
	f.Fuzz(func(t *testing.T, js string, localIDs []byte) {
		var p KVTransferParams
		if json.Unmarshal([]byte(js), &p) != nil || p.checkPull() != nil {
			return
		}
		lids := make([]int32, len(localIDs))
		for i, b := range localIDs {
			lids[i] = int32(b) - 8 // some negative, some past the 64 blocks
		}
		rem := r.AlignRemote(len(lids), p.RemoteBlockIDs)
		l, rm, notify, err := r.AppendRead(nil, nil, lids, rem)
		if err != nil {
			return
		}
		if notify != (len(lids) == 0) || len(l) != len(rm) {
			t.Fatalf("notify %v with %d local blocks; %d/%d ids", notify, len(lids), len(l), len(rm))
		}
		for i := range l {
			ld, ok1 := ll.Desc(int(l[i]))
			rd, ok2 := rl.Desc(int(rm[i]))
			if !ok1 || !ok2 || ld.Len != rd.Len {
				t.Fatalf("pair %d: local %d (%v) remote %d (%v)", i, l[i], ok1, rm[i], ok2)
			}
		}
	})
}
