package pullworker

import (
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvhost/kvhost/host/demo/kvpool"
	"github.com/kvhost/kvhost/host/internal/faketest"
	"github.com/kvhost/kvhost/host/pull"
	"github.com/kvhost/kvhost/host/wire/vllm"
)

// BenchmarkTwoProcessPull measures one request's READ from a prefill
// process through the whole pull runtime on the fake plugin, beside a
// baseline measured in the same iterations: one raw process_vm_readv
// system call batch moving exactly the same blocks between the same
// buffers. It reports both rates and their ratio.
//
//	go test ./host/demo/pullworker -run '^$' -bench TwoProcessPull -benchtime 100x
func BenchmarkTwoProcessPull(b *testing.B) {
	for _, tokens := range []int{512, 64} {
		b.Run(fmt.Sprintf("llama-%dtok", tokens), func(b *testing.B) { benchTwoProcess(b, tokens) })
	}
}

func benchTwoProcess(b *testing.B, tokens int) {
	// 16 layers, 8 KV heads of 128 bf16: 32 KiB per region block, 32
	// regions; 512 tokens move 32 MiB.
	model := Model{Name: "bench", VLLMVersion: "0.13.0", DType: "bfloat16", CacheDType: "auto", Layers: 16, KVHeads: 8, HeadDim: 128}
	e := Engine{TPSize: 1, BlockSize: 16, NumBlocks: 128, Layout: pull.LayoutHND}
	pc := startChild(b, "prefill", childSpec{Model: model, Engine: e, EngineID: "bench-prefill", AbortTimeout: time.Minute})
	var ready struct{ API string }
	pc.line(b, &ready)
	client := newPrefillClient("http://"+ready.API, 0)
	pool, err := kvpool.New(geometry(model, e, 0))
	if err != nil {
		b.Fatal(err)
	}
	defer pool.Close()
	a, err := faketest.Plugin(b).NewAgent(agentName("bench-decode", 0))
	if err != nil {
		b.Fatal(err)
	}
	defer a.Close()
	cache := cacheOf(pool, e, 0)
	rx, err := pull.NewReceiver(pull.ReceiverConfig{EngineID: "bench-decode", TPSize: 1, Agent: a, Cache: cache,
		TotalKVHeads: model.KVHeads, CompatHash: model.CompatHash(), Logger: testLog()})
	if err != nil {
		b.Fatal(err)
	}
	defer rx.Close()

	rng := rand.New(rand.NewPCG(5, 6))
	n := (tokens + e.BlockSize - 1) / e.BlockSize
	blockLen := cache.Regions[0].Len / uint64(e.NumBlocks)
	var md *vllm.AgentMetadata
	iov := make([]unix.Iovec, 0, 1024)
	riov := make([]unix.RemoteIovec, 0, 1024)
	var pullT, rawT, telemT time.Duration
	var bytes uint64
	b.ResetTimer()
	for i := 0; i <= b.N; i++ { // iteration 0 warms up (handshake) untimed
		id := fmt.Sprintf("b%d", i)
		params, err := client.prefill(b.Context(), id, tokens)
		if err != nil {
			b.Fatal(err)
		}
		if md == nil {
			md, err = pull.FetchHandshake(b.Context(), params.Endpoint(), 0, pull.FetchOptions{
				Expect: vllm.Expect{LocalHash: model.CompatHash(), EnforceHash: true, EngineID: params.RemoteEngineID}})
			if err != nil {
				b.Fatal(err)
			}
		}
		local := randLocal(rng, n, e.NumBlocks)
		// Baseline: the same blocks, region by region, in process_vm_readv
		// batches of up to 1024 iovecs.
		t0 := time.Now()
		for r, base := range md.KVCachesBaseAddr {
			for k, rb := range params.RemoteBlockIDs {
				iov = append(iov, unix.Iovec{Base: &cache.Host[r][uint64(local[k])*blockLen], Len: blockLen})
				riov = append(riov, unix.RemoteIovec{Base: uintptr(base + uint64(rb)*blockLen), Len: int(blockLen)})
				if len(iov) == cap(iov) {
					pvmRead(b, pc.cmd.Process.Pid, iov, riov)
					iov, riov = iov[:0], riov[:0]
				}
			}
		}
		if len(iov) > 0 {
			pvmRead(b, pc.cmd.Process.Pid, iov, riov)
			iov, riov = iov[:0], riov[:0]
		}
		t1 := time.Now()
		res := rx.Load(pull.LoadRequest{RequestID: id, LocalBlockIDs: local, Params: params}).Result()
		t2 := time.Now()
		if res.Err != nil {
			b.Fatal(res.Err)
		}
		if i == 0 {
			continue
		}
		if err := pool.Verify(kvpool.Tokens{Request: KVSeed(id), Pages: local, Count: tokens}); err != nil {
			b.Fatal(err)
		}
		rawT += t1.Sub(t0)
		pullT += t2.Sub(t1)
		bytes += res.Stat.Bytes
		telemT += res.Stat.Xfer
	}
	b.StopTimer()
	pullGB := float64(bytes) / pullT.Seconds() / 1e9
	rawGB := float64(bytes) / rawT.Seconds() / 1e9
	b.ReportMetric(pullGB, "pull_GB/s")
	b.ReportMetric(rawGB, "pvm_GB/s")
	b.ReportMetric(pullGB/rawGB, "ratio")
	b.ReportMetric(float64(pullT.Microseconds())/float64(b.N), "pull_µs/req")
	// The plugin's own post-to-completion time: the rest of pull_µs is the
	// runtime (ids, make, post, completion detection, release).
	b.ReportMetric(float64(telemT.Microseconds())/float64(b.N), "xfer_µs/req")
	b.ReportMetric(float64(n*len(cache.Regions)), "descs/req")
}

func pvmRead(b *testing.B, pid int, local []unix.Iovec, remote []unix.RemoteIovec) {
	var want uint64
	for _, v := range local {
		want += v.Len
	}
	got, err := unix.ProcessVMReadv(pid, local, remote, 0)
	if err != nil || uint64(got) != want {
		b.Fatalf("process_vm_readv: %d of %d bytes: %v", got, want, err)
	}
}

func randLocal(rng *rand.Rand, n, total int) []int32 {
	out := make([]int32, n)
	for i, b := range rng.Perm(total)[:n] {
		out[i] = int32(b)
	}
	return out
}
