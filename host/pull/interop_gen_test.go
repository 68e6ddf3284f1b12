package pull

import (
	"bufio"
	"context"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvhost/kvhost/host/demo/kvpool"
	"github.com/kvhost/kvhost/host/wire/vllm"
)

// peerMetadata6 is what the Python peer decodes of a version-6, -10, -11
// or -12 NixlAgentMetadata, and what its side channel serves (the later
// fields, when unset, as a one-group vLLM worker sends them: strides the
// block lengths, context parallel sizes 1, per region num_blocks, group 0,
// a layer name and DRAM, no region members).
type peerMetadata6 struct {
	peerMetadata
	SSMSizes                 []int  `json:"ssm_sizes"`
	AttnBackendName          string `json:"attn_backend_name"`
	PhysicalBlocksPerLogical int    `json:"physical_blocks_per_logical_kv_block"`
	// Version 10.
	BlockStrides []int `json:"block_strides,omitempty"`
	DCPSize      int   `json:"dcp_size,omitempty"`
	PCPSize      int   `json:"pcp_size,omitempty"`
	// Versions 11 and 12.
	RegionNumBlocks []int      `json:"region_num_blocks,omitempty"`
	RegionGroupIDs  []int      `json:"region_group_ids,omitempty"`
	RegionNames     []string   `json:"region_names,omitempty"`
	RegionMemTypes  []string   `json:"region_mem_types,omitempty"`
	RegionMembers   [][]string `json:"region_members,omitempty"`
}

// wantRegions is what a kvhost prefill of version 11 or 12 advertises per
// region of a cache of n regions of blocks blocks in host memory, as a
// one-group vLLM worker does (version 12 adds region_members, empty).
func wantRegions(version, n, blocks int) peerMetadata6 {
	var w peerMetadata6
	if version < 11 {
		return w
	}
	for i := range n {
		w.RegionNumBlocks = append(w.RegionNumBlocks, blocks)
		w.RegionGroupIDs = append(w.RegionGroupIDs, 0)
		w.RegionNames = append(w.RegionNames, fmt.Sprintf("kvhost.region.%d", i))
		w.RegionMemTypes = append(w.RegionMemTypes, "DRAM")
	}
	if version >= 12 {
		w.RegionMembers = [][]string{}
	}
	return w
}

// regionsOf is the region part of m.
func regionsOf(m peerMetadata6) peerMetadata6 {
	return peerMetadata6{RegionNumBlocks: m.RegionNumBlocks, RegionGroupIDs: m.RegionGroupIDs, RegionNames: m.RegionNames,
		RegionMemTypes: m.RegionMemTypes, RegionMembers: m.RegionMembers}
}

// versionsAfter6 are the leased generations the interop tests run.
var versionsAfter6 = []int{6, 10, 11, 12}

// notifNumber is what a decode rank of the version puts after the ':' of
// its READ notification: its TP size (6) or the readers of each prefill
// rank (10 on).
func notifNumber(version, ptp, dtp int) int {
	if version == 6 {
		return dtp
	}
	return max(dtp/ptp, 1)
}

type peerPayload6 struct {
	// None names the fields the Python side channel sends as None.
	None              []string      `json:"none,omitempty"`
	CompatibilityHash string        `json:"compatibility_hash"`
	Metadata          peerMetadata6 `json:"metadata"`
	ByteExact         bool          `json:"byte_exact"`
	ClockOffset       *float64      `json:"clock_offset"`
	Notif             string        `json:"notif"`
	Heartbeat         string        `json:"heartbeat"`
}

// TestInteropPythonDecodePeerV6ToV12: vLLM version-6, -10, -11 and -12
// decode ranks (Python, written from base_worker.py's _nixl_handshake and
// pull_worker.py) fetch a kvhost prefill's metadata of their version, byte
// for byte as msgspec encodes it, then send what such a rank sends: its
// heartbeat and its READ notification, "{id}:{decode TP}" (6) or
// "{id}:{readers of the rank}" (10 on); 11 and 12 also decode the region
// fields a one-group worker fills. The prefill extends the lease and
// releases each request once every decode rank reading each of its ranks
// notified (decode TP / prefill TP of them), for MHA and MLA and TP 1→1,
// 2→2 and 2→4.
func TestInteropPythonDecodePeerV6ToV12(t *testing.T) {
	needPython(t)
	for _, c := range []struct {
		name     string
		mla      bool
		ptp, dtp int
	}{{"mha-1-1", false, 1, 1}, {"mha-2-2", false, 2, 2}, {"mha-2-4", false, 2, 4}, {"mla-2-4", true, 2, 4}} {
		for _, version := range versionsAfter6 {
			t.Run(fmt.Sprintf("v%d/%s", version, c.name), func(t *testing.T) {
				gen, err := vllm.Lookup(version)
				if err != nil {
					t.Fatal(err)
				}
				g := geom{hnd: true, mla: c.mla, layers: 2, heads: 4, headBytes: 16, tp: c.ptp, blockSize: 8, blocks: 24}
				ps := newPrefillSide(t, g, "prefill-py", func(cfg *SenderConfig) { cfg.Gen, cfg.AttnBackendName = gen, "FLASH_ATTN" })
				ps.hold(t, "req-6", 3, []int32{5, 1, 9}, 20)
				var peers []peerPayload6
				for drank := range c.dtp {
					prank := drank * c.ptp / c.dtp
					ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
					out, err := exec.CommandContext(ctx, python, "testdata/vllm_nixl_peer.py", "req", ps.sender.Endpoint(),
						strconv.Itoa(prank), strconv.Itoa(version), strconv.Itoa(c.dtp), "req-6", strconv.Itoa(c.ptp)).Output()
					cancel()
					if err != nil {
						t.Fatalf("decode rank %d: %v\n%s", drank, err, stderrOf(err))
					}
					var got peerPayload6
					if err := json.Unmarshal(out, &got); err != nil {
						t.Fatalf("%v: %s", err, out)
					}
					blob, _ := ps.agents[prank].LocalMetadata()
					want := peerMetadata{EngineID: "prefill-py", AgentMetadata: hex.EncodeToString(blob), NumBlocks: g.blocks,
						KVCacheLayout: "HND", BlockSize: g.blockSize}
					for _, r := range ps.pools[prank].Regions() {
						want.KVCachesBaseAddr = append(want.KVCachesBaseAddr, r.Addr)
						want.BlockLens = append(want.BlockLens, int(r.Len)/g.blocks)
					}
					if !got.ByteExact || got.CompatibilityHash != testHash || !reflect.DeepEqual(got.Metadata.peerMetadata, want) ||
						!reflect.DeepEqual(got.Metadata.SSMSizes, []int{0, 0}) || got.Metadata.AttnBackendName != "FLASH_ATTN" ||
						got.Metadata.PhysicalBlocksPerLogical != 1 || got.ClockOffset == nil {
						t.Fatalf("decode rank %d got %+v", drank, got)
					}
					v10 := peerMetadata6{BlockStrides: got.Metadata.BlockLens, DCPSize: 1, PCPSize: 1}
					if version < 10 {
						v10 = peerMetadata6{}
					}
					if !reflect.DeepEqual(got.Metadata.BlockStrides, v10.BlockStrides) || got.Metadata.DCPSize != v10.DCPSize || got.Metadata.PCPSize != v10.PCPSize {
						t.Fatalf("decode rank %d: version %d fields %+v", drank, version, got.Metadata)
					}
					if w := wantRegions(version, len(want.KVCachesBaseAddr), g.blocks); !reflect.DeepEqual(regionsOf(got.Metadata), w) {
						t.Fatalf("decode rank %d: version %d region fields %+v, want %+v", drank, version, regionsOf(got.Metadata), w)
					}
					if wantNotif := fmt.Sprintf("req-6:%d", notifNumber(version, c.ptp, c.dtp)); got.Notif != wantNotif {
						t.Fatalf("decode rank %d: notification %q, want %q", drank, got.Notif, wantNotif)
					}
					peers = append(peers, got)
				}
				// Each decode rank is an agent that loaded the metadata Python
				// decoded and sends Python's messages.
				per := max(c.dtp/c.ptp, 1)
				for drank, p := range peers {
					a := newAgent(t, fmt.Sprintf("vllm-d%d", drank))
					blob, _ := hex.DecodeString(p.Metadata.AgentMetadata)
					name, err := a.LoadRemote(blob)
					if err != nil {
						t.Fatal(err)
					}
					hb := ps.sender.Counts().Heartbeats
					if err := a.SendNotif(name, []byte(p.Heartbeat)); err != nil {
						t.Fatal(err)
					}
					eventually(t, "the heartbeat", 10*time.Second, func() bool { return ps.sender.Counts().Heartbeats == hb+1 })
					if err := a.SendNotif(name, []byte(p.Notif)); err != nil {
						t.Fatal(err)
					}
					if drank == c.dtp-1 {
						break
					}
					// Not released before every reader of every prefill rank notified.
					eventually(t, "the notification", 10*time.Second, func() bool { return ps.sender.Counts().Notifications == 2*(drank+1) })
					if len(ps.releases) != 0 {
						t.Fatalf("released after %d of %d notifications (%d per prefill rank)", drank+1, c.dtp, per)
					}
				}
				select {
				case rel := <-ps.releases:
					if rel.Reason != ReleaseNotified || rel.Notified != c.dtp {
						t.Fatalf("%+v", rel)
					}
				case <-time.After(10 * time.Second):
					t.Fatalf("not released: %+v", ps.sender.Counts())
				}
				if c := ps.sender.Counts(); c.UnknownNotifications+c.MalformedNotifications != 0 {
					t.Fatalf("%+v", c)
				}
			})
		}
	}
}

// pythonRouter starts the Python vLLM prefill side channel of a version
// serving spec for n requests and returns its port and a wait for "OK n".
func pythonRouter(t *testing.T, spec any, n, version int) (int, func()) {
	specPath := filepath.Join(t.TempDir(), "spec.json")
	b, _ := json.Marshal(spec)
	if err := os.WriteFile(specPath, b, 0o600); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	cmd := exec.CommandContext(ctx, python, "testdata/vllm_nixl_peer.py", "router", specPath, strconv.Itoa(n), strconv.Itoa(version))
	cmd.Stderr = os.Stderr
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cancel(); cmd.Wait() })
	lines := bufio.NewScanner(stdout)
	if !lines.Scan() || !strings.HasPrefix(lines.Text(), "PORT ") {
		t.Fatalf("python router did not start: %q", lines.Text())
	}
	port, _ := strconv.Atoi(strings.TrimPrefix(lines.Text(), "PORT "))
	return port, func() {
		if !lines.Scan() || lines.Text() != fmt.Sprintf("OK %d", n) {
			t.Fatalf("python router: %q", lines.Text())
		}
	}
}

// pyPrefill is a prefill whose agents and pools live in this process and
// whose side channel is the Python peer.
type pyPrefill struct {
	spec   map[string]peerPayload
	notifs []func() []string
}

func newPyPrefill(t *testing.T, g geom, engineID string, blocks []int32, seed uint64, tokens int) *pyPrefill {
	pp := &pyPrefill{spec: map[string]peerPayload{}}
	for rank := range g.tp {
		p := g.pool(t, rank)
		if err := p.Fill(kvpool.Tokens{Request: seed, Pages: blocks, Count: tokens}); err != nil {
			t.Fatal(err)
		}
		a := newAgent(t, "pyprefill")
		c := cacheOf(p, g.layout())
		regs, err := register(a, &c)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { a.Deregister(regs...) })
		blob, err := a.LocalMetadata()
		if err != nil {
			t.Fatal(err)
		}
		md := metadataOf(engineID, blob, &c)
		pp.spec[strconv.Itoa(rank)] = peerPayload{CompatibilityHash: testHash, Metadata: peerMetadata{
			EngineID: md.EngineID, AgentMetadata: hex.EncodeToString(md.AgentMetadata), KVCachesBaseAddr: md.KVCachesBaseAddr,
			DeviceID: md.DeviceID, NumBlocks: md.NumBlocks, BlockLens: md.BlockLens, KVCacheLayout: md.KVCacheLayout, BlockSize: md.BlockSize}}
		pp.notifs = append(pp.notifs, func() []string {
			ns, err := a.Notifs()
			if err != nil {
				t.Error(err)
			}
			var out []string
			for _, n := range ns {
				out = append(out, string(n.Msg))
			}
			return out
		})
	}
	return pp
}

// TestInteropGoDecodeFromPythonPrefillV6ToV12: kvhost version-6, -10, -11
// and -12 decode ranks handshake with a Python vLLM prefill side channel of their
// version (3-tuple request, reply with the clock frame, the version's
// metadata), read every block, partial and full prefix hits, MHA and MLA,
// TP 1→1, 2→2 and 2→4, and notify each prefill rank as pull_worker.py of
// the version does: "{id}:{decode TP}" (6), "{id}:{readers of the rank}"
// (10 on). The version-11 and -12 prefills advertise their regions as a
// one-group vLLM worker does.
func TestInteropGoDecodeFromPythonPrefillV6ToV12(t *testing.T) {
	needPython(t)
	for _, c := range []struct {
		name     string
		mla      bool
		ptp, dtp int
		hit      int
	}{
		{"mha-1-1", false, 1, 1, 0}, {"mha-2-2-partial", false, 2, 2, 1}, {"mha-2-4", false, 2, 4, 0},
		{"mha-2-4-full-hit", false, 2, 4, 3}, {"mla-2-4-partial", true, 2, 4, 2},
	} {
		for _, version := range versionsAfter6 {
			t.Run(fmt.Sprintf("v%d/%s", version, c.name), func(t *testing.T) {
				gen, err := vllm.Lookup(version)
				if err != nil {
					t.Fatal(err)
				}
				g := geom{hnd: true, mla: c.mla, layers: 2, heads: 4, headBytes: 16, tp: c.ptp, blockSize: 8, blocks: 32}
				blocks := []int32{9, 4, 17}
				pp := newPyPrefill(t, g, "py-engine", blocks, 77, 20)
				dg := g
				dg.tp = c.dtp
				ds := newDecodeSide(t, dg, func(cfg *ReceiverConfig) { cfg.Gen = gen })
				port, done := pythonRouter(t, pp.spec, c.dtp, version)
				params := KVTransferParams{DoRemotePrefill: true, RemoteBlockIDs: blocks, RemoteEngineID: "py-engine",
					RemoteRequestID: "py-req", RemoteHost: "127.0.0.1", RemotePort: port, TPSize: c.ptp}
				local := []int32{30, 1, 12}
				for rank, rx := range ds.rx {
					// The decode's own prefix cache holds the first hit blocks.
					if err := ds.pools[rank].Fill(kvpool.Tokens{Request: 77, Pages: local, Count: min(c.hit*g.blockSize, 20)}); err != nil {
						t.Fatal(err)
					}
					res := wait(t, rx.Load(LoadRequest{RequestID: "d", LocalBlockIDs: local[c.hit:], Params: params}))
					if res.Err != nil || res.NotifyOnly != (c.hit == len(local)) {
						t.Fatalf("rank %d: %+v", rank, res)
					}
					if err := ds.pools[rank].Verify(kvpool.Tokens{Request: 77, Pages: local, Count: 20}); err != nil {
						t.Fatalf("rank %d: %v", rank, err)
					}
				}
				done()
				// MLA with a larger decode reads one prefill rank per decode
				// rank, as MHA does here: each prefill rank hears from
				// decode TP / prefill TP readers.
				want := make([]string, c.dtp/c.ptp)
				for i := range want {
					want[i] = fmt.Sprintf("py-req:%d", notifNumber(version, c.ptp, c.dtp))
				}
				for rank := range c.ptp {
					var got []string
					eventually(t, "notifications", 5*time.Second, func() bool {
						got = append(got, pp.notifs[rank]()...)
						return len(got) >= len(want)
					})
					if !reflect.DeepEqual(got, want) {
						t.Fatalf("prefill rank %d notified %q, want %q", rank, got, want)
					}
				}
			})
		}
	}
}

// TestInteropV10Refusals: a version-10 Python prefill whose metadata says
// what kvhost cannot read (blocks not back to back, a context parallel
// engine) fails the kvhost decode's read naming the field, and the decode
// reads nothing.
func TestInteropV10Refusals(t *testing.T) {
	needPython(t)
	gen, err := vllm.Lookup(10)
	if err != nil {
		t.Fatal(err)
	}
	g := geom{hnd: true, layers: 2, heads: 4, headBytes: 16, tp: 1, blockSize: 8, blocks: 32}
	blocks := []int32{9, 4, 17}
	pp := newPyPrefill(t, g, "py-engine", blocks, 77, 20)
	for _, c := range []struct {
		name, want string
		edit       func(*peerMetadata6)
	}{
		{"strides", "block_strides", func(m *peerMetadata6) {
			for _, l := range m.BlockLens {
				m.BlockStrides = append(m.BlockStrides, 2*l)
			}
		}},
		{"dcp", "dcp_size 2", func(m *peerMetadata6) { m.DCPSize = 2 }},
		{"pcp", "pcp_size 2", func(m *peerMetadata6) { m.PCPSize = 2 }},
	} {
		t.Run(c.name, func(t *testing.T) {
			md := peerMetadata6{peerMetadata: pp.spec["0"].Metadata, SSMSizes: []int{0, 0}, AttnBackendName: "FLASH_ATTN",
				PhysicalBlocksPerLogical: 1}
			c.edit(&md)
			spec := map[string]peerPayload6{"0": {CompatibilityHash: testHash, Metadata: md}}
			ds := newDecodeSide(t, g, func(cfg *ReceiverConfig) { cfg.Gen = gen })
			port, done := pythonRouter(t, spec, 1, 10)
			local := []int32{30, 1, 12}
			res := wait(t, ds.rx[0].Load(LoadRequest{RequestID: "d", LocalBlockIDs: local, Params: KVTransferParams{
				DoRemotePrefill: true, RemoteBlockIDs: blocks, RemoteEngineID: "py-engine", RemoteRequestID: "r",
				RemoteHost: "127.0.0.1", RemotePort: port, TPSize: 1}}))
			done()
			if res.Err == nil || !strings.Contains(res.Err.Error(), c.want) || !strings.Contains(res.Err.Error(), "kvhost reads") {
				t.Fatalf("want a refusal naming %q, got %+v", c.want, res)
			}
			if err := ds.pools[0].Verify(kvpool.Tokens{Request: 77, Pages: local, Count: 20}); err == nil {
				t.Fatal("the refused read wrote the decode's blocks")
			}
		})
	}
}

// TestInteropCrossGeneration: a peer of another generation is refused
// with both versions named, never misread. A kvhost decode of one
// generation against a Python prefill of the other fails its handshake
// (reply frames); a Python decode of the other generation gets kvhost
// prefill's empty refusal, and the side channel goes on serving its own.
func TestInteropCrossGeneration(t *testing.T) {
	needPython(t)
	g := geom{hnd: true, layers: 2, heads: 4, headBytes: 16, tp: 1, blockSize: 8, blocks: 32}
	blocks := []int32{3}
	for _, c := range []struct{ decode, prefill int }{{6, 2}, {2, 6}} {
		pp := newPyPrefill(t, g, "py-engine", blocks, 1, 8)
		dgen, _ := vllm.Lookup(c.decode)
		ds := newDecodeSide(t, g, func(cfg *ReceiverConfig) { cfg.Gen = dgen })
		port, done := pythonRouter(t, pp.spec, 1, c.prefill)
		res := wait(t, ds.rx[0].Load(LoadRequest{RequestID: "d", LocalBlockIDs: []int32{0}, Params: KVTransferParams{
			DoRemotePrefill: true, RemoteBlockIDs: blocks, RemoteEngineID: "py-engine", RemoteRequestID: "r",
			RemoteHost: "127.0.0.1", RemotePort: port, TPSize: 1}}))
		done()
		msg := fmt.Sprint(res.Err)
		if !errors.Is(res.Err, ErrHandshake) || !errors.Is(res.Err, vllm.ErrGeneration) ||
			!strings.Contains(msg, map[int]string{2: "as version 2 sends", 6: "as versions 6, 10, 11, 12 send"}[c.prefill]) || !strings.Contains(msg, fmt.Sprintf("version %d", c.decode)) {
			t.Fatalf("decode v%d, prefill v%d: %v", c.decode, c.prefill, res.Err)
		}
	}
	for _, c := range []struct{ prefill, decode int }{{6, 2}, {2, 6}} {
		pgen, _ := vllm.Lookup(c.prefill)
		ps := newPrefillSide(t, g, "prefill-py", func(cfg *SenderConfig) { cfg.Gen = pgen })
		ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
		out, err := exec.CommandContext(ctx, python, "testdata/vllm_nixl_peer.py", "req", ps.sender.Endpoint(), "0", strconv.Itoa(c.decode)).CombinedOutput()
		cancel()
		if err == nil {
			t.Fatalf("a version-%d decode read a version-%d prefill: %s", c.decode, c.prefill, out)
		}
		ctx, cancel = context.WithTimeout(t.Context(), 20*time.Second)
		out, err = exec.CommandContext(ctx, python, "testdata/vllm_nixl_peer.py", "req", ps.sender.Endpoint(), "0", strconv.Itoa(c.prefill)).Output()
		cancel()
		if err != nil || !strings.Contains(string(out), `"byte_exact": true`) {
			t.Fatalf("version %d after the refusal: %v %s", c.prefill, err, out)
		}
	}
}

// TestInteropV12Refusals: a version-11 or -12 Python prefill whose region
// fields describe what kvhost cannot map (regions of another size, a
// hybrid model's several groups, another memory type, layers pooled in a
// region), or that disagree with its regions, fails the kvhost decode's read
// naming the field, and the decode reads nothing. A prefill that says
// nothing (None) is read.
func TestInteropV12Refusals(t *testing.T) {
	needPython(t)
	g := geom{hnd: true, layers: 2, heads: 4, headBytes: 16, tp: 1, blockSize: 8, blocks: 32}
	blocks := []int32{9, 4, 17}
	pp := newPyPrefill(t, g, "py-engine", blocks, 77, 20)
	regions := len(pp.spec["0"].Metadata.KVCachesBaseAddr)
	for _, c := range []struct {
		name, want string
		version    int
		edit       func(*peerMetadata6)
	}{
		{"blocks", "region_num_blocks[1] is 16", 12, func(m *peerMetadata6) {
			m.RegionNumBlocks = make([]int, regions)
			for i := range m.RegionNumBlocks {
				m.RegionNumBlocks[i] = m.NumBlocks
			}
			m.RegionNumBlocks[1] = m.NumBlocks / 2
		}},
		{"groups", "region_group_ids[1] is 1", 11, func(m *peerMetadata6) {
			m.RegionGroupIDs = make([]int, regions)
			for i := range m.RegionGroupIDs {
				m.RegionGroupIDs[i] = i % 2
			}
		}},
		{"vram", `region_mem_types[0] is "VRAM"`, 12, func(m *peerMetadata6) {
			m.RegionMemTypes = make([]string, regions)
			for i := range m.RegionMemTypes {
				m.RegionMemTypes[i] = "VRAM"
			}
		}},
		{"pooled", "region_members[0] pools 2 layers", 12, func(m *peerMetadata6) {
			m.RegionMembers = make([][]string, regions)
			for i := range m.RegionMembers {
				m.RegionMembers[i] = []string{fmt.Sprintf("l%d", i)}
			}
			m.RegionMembers[0] = append(m.RegionMembers[0], "l0.swa")
		}},
		{"short", `"region_names" has 1 entries for 4 regions`, 11, func(m *peerMetadata6) { m.RegionNames = []string{"a"} }},
		{"group-range", "region_group_ids[0] is 4", 12, func(m *peerMetadata6) {
			m.RegionGroupIDs = make([]int, regions)
			m.RegionGroupIDs[0] = regions
		}},
	} {
		t.Run(c.name, func(t *testing.T) {
			gen, err := vllm.Lookup(c.version)
			if err != nil {
				t.Fatal(err)
			}
			md := peerMetadata6{peerMetadata: pp.spec["0"].Metadata, SSMSizes: []int{0, 0}, AttnBackendName: "FLASH_ATTN",
				PhysicalBlocksPerLogical: 1}
			c.edit(&md)
			spec := map[string]peerPayload6{"0": {CompatibilityHash: testHash, Metadata: md}}
			ds := newDecodeSide(t, g, func(cfg *ReceiverConfig) { cfg.Gen = gen })
			port, done := pythonRouter(t, spec, 1, c.version)
			local := []int32{30, 1, 12}
			res := wait(t, ds.rx[0].Load(LoadRequest{RequestID: "d", LocalBlockIDs: local, Params: KVTransferParams{
				DoRemotePrefill: true, RemoteBlockIDs: blocks, RemoteEngineID: "py-engine", RemoteRequestID: "r",
				RemoteHost: "127.0.0.1", RemotePort: port, TPSize: 1}}))
			done()
			if res.Err == nil || !strings.Contains(res.Err.Error(), c.want) {
				t.Fatalf("want a refusal naming %q, got %+v", c.want, res)
			}
			if err := ds.pools[0].Verify(kvpool.Tokens{Request: 77, Pages: local, Count: 20}); err == nil {
				t.Fatal("the refused read wrote the decode's blocks")
			}
		})
	}
	if regions != 4 {
		t.Fatalf("the cases assume 4 regions, the cache has %d", regions)
	}
	// None in every region list: read as one uniform group.
	md := peerMetadata6{peerMetadata: pp.spec["0"].Metadata, SSMSizes: []int{0, 0}, AttnBackendName: "FLASH_ATTN", PhysicalBlocksPerLogical: 1}
	spec := map[string]peerPayload6{"0": {CompatibilityHash: testHash, Metadata: md,
		None: []string{"region_num_blocks", "region_group_ids", "region_names", "region_mem_types"}}}
	g12, err := vllm.Lookup(12)
	if err != nil {
		t.Fatal(err)
	}
	ds := newDecodeSide(t, g, func(cfg *ReceiverConfig) { cfg.Gen = g12 })
	port, done := pythonRouter(t, spec, 1, 12)
	local := []int32{30, 1, 12}
	res := wait(t, ds.rx[0].Load(LoadRequest{RequestID: "d", LocalBlockIDs: local, Params: KVTransferParams{
		DoRemotePrefill: true, RemoteBlockIDs: blocks, RemoteEngineID: "py-engine", RemoteRequestID: "r",
		RemoteHost: "127.0.0.1", RemotePort: port, TPSize: 1}}))
	done()
	if res.Err != nil {
		t.Fatal(res.Err)
	}
	if err := ds.pools[0].Verify(kvpool.Tokens{Request: 77, Pages: local, Count: 20}); err != nil {
		t.Fatal(err)
	}
}
