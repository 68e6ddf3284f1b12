package plugin

import (
	"context"
	"fmt"
	"runtime/metrics"
	"slices"
	"testing"
	"time"

	"github.com/ebitengine/purego"
	"github.com/kvhost/kvhost/abi"
)

// Benchmarks report each measurement beside a baseline measured in the same
// run, interleaved in small chunks, so that a noisy shared machine moves
// both alike; compare the ratios, not the absolute numbers.
//
//	go test -run '^$' -bench . -benchtime 2000x ./host/plugin/

//go:noinline
func goCall(x uintptr) uintptr { return x + 1 }

// Measuring: each sample times the host path and its baselines side by
// side with time.Now, and the benchmarks never call b.StopTimer or
// b.StartTimer in their loops: each of those reads the memory statistics,
// which stops the world, and a transfer timed right after that ran ~25%
// slower than one timed after a baseline (measured: 60 against 47 µs for
// 1 MiB), which biased the ratio. ns/op is reported as the median host
// time, not the loop's mean.

// interleaved holds measurements of the host path and of a baseline taken
// side by side, one pair per sample. On a shared machine a stall lands in
// one sample and drags a mean, not a median: the summaries are medians, and
// the ratio is the median of the per-sample ratios, so host and baseline
// are compared under the same conditions.
type interleaved struct{ host, base []time.Duration }

func newInterleaved(n int) *interleaved {
	return &interleaved{host: make([]time.Duration, 0, n), base: make([]time.Duration, 0, n)}
}

func (m *interleaved) add(host, base time.Duration) {
	m.host = append(m.host, host)
	m.base = append(m.base, base)
}

// ratio is the median of base/host: above 1 the host path is faster.
func (m *interleaved) ratio() float64 {
	r := make([]float64, len(m.host))
	for i := range r {
		r[i] = float64(m.base[i]) / float64(max(m.host[i], 1))
	}
	slices.Sort(r)
	return r[len(r)/2]
}

func median(ds []time.Duration) time.Duration {
	s := slices.Clone(ds)
	slices.Sort(s)
	return s[len(s)/2]
}

// BenchmarkPluginCall measures one plugin call through the host: Xfer.Poll
// of a completed transfer (poll_xfer, with the host's locking and error
// check). Baselines: purego.SyscallN of libc's labs, and a plain Go call.
// Calls run in chunks of 256, host and baselines alternating; the metrics
// are medians over the chunks.
func BenchmarkPluginCall(b *testing.B) {
	p := openFake(b)
	a := newSide(b, p, "a", []int{4096})
	s := newSide(b, p, "b", []int{4096})
	peer := connect(b, a, s)
	rr, err := a.a.ImportRange(peer, addr(s.bufs[0]), 4096, 0, abi.DRAM)
	if err != nil {
		b.Fatal(err)
	}
	x, err := a.a.MakeBatchXfer(abi.Write, []Pair{{a.regions[0], rr}}, []abi.BatchEntry{{Len: 64, Count: 1}}, nil)
	if err != nil {
		b.Fatal(err)
	}
	defer x.Close()
	wait(b, x)
	labs := libcFunc(b, "labs")
	labsArg := []uintptr{^uintptr(4)} // reused: a fresh variadic slice would allocate per call
	const chunk = 256
	chunks := (b.N + chunk - 1) / chunk
	raw, gocall := newInterleaved(chunks), newInterleaved(chunks)
	var sink uintptr
	b.ReportAllocs()
	b.ResetTimer()
	for done := 0; done < b.N; done += chunk {
		n := min(chunk, b.N-done)
		t0 := time.Now()
		for range n {
			if ok, err := x.Poll(); !ok || err != nil {
				b.Fatal(ok, err)
			}
		}
		t1 := time.Now()
		for range n {
			r, _, _ := purego.SyscallN(labs, labsArg...)
			sink += r
		}
		t2 := time.Now()
		for i := range n {
			sink += goCall(uintptr(i))
		}
		t3 := time.Now()
		perCall := func(d time.Duration) time.Duration { return d / time.Duration(n) }
		raw.add(perCall(t1.Sub(t0)), perCall(t2.Sub(t1)))
		gocall.add(perCall(t1.Sub(t0)), perCall(t3.Sub(t2)))
	}
	b.StopTimer()
	if sink == 42 {
		b.Log(sink)
	}
	b.ReportMetric(float64(median(raw.host)), "ns/op")
	b.ReportMetric(float64(median(raw.host)), "host-ns/call")
	b.ReportMetric(float64(median(raw.base)), "purego-ns/call")
	b.ReportMetric(float64(median(gocall.base)), "go-ns/call")
	b.ReportMetric(1/raw.ratio(), "host/purego")
}

// minTransferRatio is what a 1 MiB same-process transfer through the host
// must reach: this fraction of a direct memcpy's rate (issue 2).
const minTransferRatio = 0.9

// minRatioSamples is how many interleaved pairs it takes to hold the
// transfer to minTransferRatio.
const minRatioSamples = 100

// BenchmarkTransfer1MiB measures a 1 MiB WRITE between two agents of one
// process (post + wait through the host and the fake plugin) beside two raw
// copies between the same mmap'd buffers, in every iteration, the order
// alternating: Go's copy() of the transfer's blocks, and one libc memcpy of
// the whole MiB (what the fake itself calls per block). The metrics are
// medians; host/libc-memcpy and host/copy are medians of the per-iteration
// rate ratios, and the benchmark fails when a one-descriptor transfer's
// host/libc-memcpy is below minTransferRatio (given minRatioSamples
// iterations, e.g. -benchtime 2000x). host-µs minus plugin-µs (the
// plugin's own post-to-completion time, from telemetry) is what the host
// adds.
func BenchmarkTransfer1MiB(b *testing.B) {
	const size = 1 << 20
	for _, tc := range []struct {
		name   string
		params []Param
		batch  bool
		blocks int
	}{
		{"prepped", nil, false, 1},
		{"batch", nil, true, 1},
		{"prepped-256x4KiB", nil, false, 256},
		{"batch-256x4KiB", nil, true, 256},
		{"emulated-prepped", []Param{{"caps_off", "prepped"}}, false, 1},
		{"emulated-batch", []Param{{"caps_off", "batch"}}, true, 1},
	} {
		b.Run(tc.name, func(b *testing.B) {
			p := openFake(b)
			src := newSide(b, p, "src", []int{size}, tc.params...)
			dst := newSide(b, p, "dst", []int{size})
			peer := connect(b, src, dst)
			fill(src.bufs[0], 9)
			x := makeBench(b, src, dst, peer, size, tc.blocks, tc.batch)
			defer x.Close()
			ctx := context.Background()
			memcpy := libcFunc(b, "memcpy")
			// Reused: a fresh variadic slice would allocate per call.
			memcpyArgs := []uintptr{uintptr(addr(dst.bufs[0])), uintptr(addr(src.bufs[0])), size}
			bs := size / tc.blocks
			baselines := func() (goCopy, libc time.Duration) {
				t0 := time.Now()
				for i := range tc.blocks { // the transfer's blocks, as makeBench lays them out
					copy(dst.bufs[0][(tc.blocks-1-i)*bs:(tc.blocks-i)*bs], src.bufs[0][i*bs:(i+1)*bs])
				}
				t1 := time.Now()
				purego.SyscallN(memcpy, memcpyArgs...)
				return t1.Sub(t0), time.Since(t1)
			}
			cmem, cp := newInterleaved(b.N), newInterleaved(b.N)
			inPlugin, inPost := make([]time.Duration, 0, b.N), make([]time.Duration, 0, b.N)
			b.ReportAllocs()
			// Warm both paths (page faults, worker start).
			for range 3 {
				runBench(b, ctx, x)
				baselines()
			}
			b.ResetTimer()
			for i := range b.N {
				var goCopy, libc time.Duration
				if i%2 == 1 {
					goCopy, libc = baselines()
				}
				t0 := time.Now()
				runBench(b, ctx, x)
				host := time.Since(t0)
				if i%2 == 0 {
					goCopy, libc = baselines()
				}
				if tel, err := x.Telemetry(); err == nil { // where the time went
					inPlugin = append(inPlugin, tel.Xfer)
					inPost = append(inPost, tel.Post)
				}
				cmem.add(host, libc)
				cp.add(host, goCopy)
			}
			b.StopTimer()
			us := func(d time.Duration) float64 { return float64(d.Nanoseconds()) / 1e3 }
			gbs := func(d time.Duration) float64 { return size / d.Seconds() / 1e9 }
			b.ReportMetric(float64(median(cmem.host)), "ns/op")
			b.ReportMetric(us(median(cmem.host)), "host-µs/xfer")
			if len(inPlugin) > 0 {
				b.ReportMetric(us(median(inPlugin)), "plugin-µs/xfer")
				b.ReportMetric(us(median(inPost)), "post-µs/xfer")
			}
			b.ReportMetric(us(median(cp.base)), "copy-µs")
			b.ReportMetric(us(median(cmem.base)), "libc-memcpy-µs")
			b.ReportMetric(gbs(median(cmem.host)), "host-GB/s")
			b.ReportMetric(gbs(median(cmem.base)), "libc-memcpy-GB/s")
			b.ReportMetric(cp.ratio(), "host/copy")
			ratio := cmem.ratio()
			b.ReportMetric(ratio, "host/libc-memcpy")
			// The threshold is for one 1 MiB descriptor against one 1 MiB
			// memcpy; many blocks are compared with copy() of the same
			// blocks (host/copy) for information. A handful of samples (the
			// testing package's first run has b.N == 1) says nothing.
			if tc.blocks == 1 && ratio < minTransferRatio && b.N >= minRatioSamples {
				b.Errorf("the transfer reaches %.3fx the rate of a direct memcpy (median of %d interleaved pairs), want at least %.1fx", ratio, b.N, minTransferRatio)
			}
		})
	}
}

func makeBench(b *testing.B, src, dst *side, peer string, size, blocks int, batch bool) *Xfer {
	bs := uint64(size / blocks)
	var x *Xfer
	var err error
	if batch {
		rr, ierr := src.a.ImportRange(peer, addr(dst.bufs[0]), uint64(size), 0, abi.DRAM)
		if ierr != nil {
			b.Fatal(ierr)
		}
		entries := make([]abi.BatchEntry, blocks)
		for i := range entries {
			// Blocks in reverse order on the remote side: no two adjacent
			// blocks are contiguous on both sides.
			entries[i] = abi.BatchEntry{LocalOffset: uint64(i) * bs, RemoteOffset: uint64(blocks-1-i) * bs, Len: bs, Count: 1}
		}
		x, err = src.a.MakeBatchXfer(abi.Write, []Pair{{src.regions[0], rr}}, entries, nil)
	} else {
		ld := make([]abi.XferDesc, blocks)
		rd := make([]abi.XferDesc, blocks)
		idx := make([]int32, blocks)
		for i := range ld {
			ld[i] = abi.XferDesc{Addr: addr(src.bufs[0]) + uint64(i)*bs, Len: bs, Count: 1}
			rd[i] = abi.XferDesc{Addr: addr(dst.bufs[0]) + uint64(blocks-1-i)*bs, Len: bs, Count: 1}
			idx[i] = int32(i)
		}
		l, perr := src.a.PrepLocal(abi.DRAM, ld)
		if perr != nil {
			b.Fatal(perr)
		}
		r, perr := src.a.PrepRemote(peer, abi.DRAM, rd)
		if perr != nil {
			b.Fatal(perr)
		}
		x, err = src.a.MakePreppedXfer(abi.Write, l, idx, r, idx, nil)
	}
	if err != nil {
		b.Fatal(err)
	}
	return x
}

func runBench(b *testing.B, ctx context.Context, x *Xfer) {
	done, err := x.Post()
	if err == nil && !done {
		err = x.Wait(ctx)
	}
	if err != nil {
		b.Fatal(err)
	}
}

// BenchmarkMakeXfer measures building and releasing a transfer of n
// descriptors (the per-request cost; n = 1 shows the fixed part), through
// MakePreppedXfer natively and emulated over make_batch_xfer, and through
// MakeBatchXfer natively.
func BenchmarkMakeXfer(b *testing.B) {
	for _, n := range []int{1, 64, 4096} {
		for _, tc := range []struct {
			name   string
			params []Param
			batch  bool
		}{{"prepped", nil, false}, {"emulated-prepped", []Param{{"caps_off", "prepped"}}, false}, {"batch", nil, true}} {
			params := tc.params
			b.Run(fmt.Sprintf("%s/descs=%d", tc.name, n), func(b *testing.B) {
				p := openFake(b)
				src := newSide(b, p, "src", []int{n * 64}, params...)
				dst := newSide(b, p, "dst", []int{n * 64})
				peer := connect(b, src, dst)
				ld := make([]abi.XferDesc, n)
				rd := make([]abi.XferDesc, n)
				idx := make([]int32, n)
				for i := range ld {
					ld[i] = abi.XferDesc{Addr: addr(src.bufs[0]) + uint64(i)*64, Len: 32, Count: 1}
					rd[i] = abi.XferDesc{Addr: addr(dst.bufs[0]) + uint64(i)*64, Len: 32, Count: 1}
					idx[i] = int32(n - 1 - i)
				}
				l, err := src.a.PrepLocal(abi.DRAM, ld)
				if err != nil {
					b.Fatal(err)
				}
				r, err := src.a.PrepRemote(peer, abi.DRAM, rd)
				if err != nil {
					b.Fatal(err)
				}
				rr, err := src.a.ImportRange(peer, addr(dst.bufs[0]), uint64(n*64), 0, abi.DRAM)
				if err != nil {
					b.Fatal(err)
				}
				pairs := []Pair{{src.regions[0], rr}}
				entries := make([]abi.BatchEntry, n)
				for i := range entries {
					entries[i] = abi.BatchEntry{LocalOffset: uint64(i) * 64, RemoteOffset: uint64(n-1-i) * 64, Len: 32, Count: 1}
				}
				b.ReportAllocs()
				b.ResetTimer()
				for range b.N {
					var x *Xfer
					if tc.batch {
						x, err = src.a.MakeBatchXfer(abi.Write, pairs, entries, nil)
					} else {
						x, err = src.a.MakePreppedXfer(abi.Write, l, idx, r, idx, nil)
					}
					if err != nil {
						b.Fatal(err)
					}
					x.Close()
				}
				b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/float64(n), "ns/desc")
			})
		}
	}
}

// BenchmarkNotifs measures Agent.Notifs: "empty" is one call of an idle
// polling loop (nothing queued: one get_notifs, no allocation); "recv-N"
// receives N notifications of one sender per call (sent outside the
// timing, interleaved in chunks), reported per notification.
func BenchmarkNotifs(b *testing.B) {
	p := openFake(b)
	a := newSide(b, p, "a", []int{4096})
	s := newSide(b, p, "b", []int{4096})
	peer := connect(b, s, a)
	b.Run("empty", func(b *testing.B) {
		b.ReportAllocs()
		for range b.N {
			if got, err := a.a.Notifs(); err != nil || got != nil {
				b.Fatal(got, err)
			}
		}
	})
	msg := []byte("kv-done:bootstrap-room-1234567")
	for _, n := range []int{1, 64} {
		b.Run(fmt.Sprintf("recv-%d", n), func(b *testing.B) {
			var inNotifs time.Duration
			var allocs uint64
			// runtime/metrics, not ReadMemStats: it does not stop the world.
			sample := []metrics.Sample{{Name: "/gc/heap/allocs:objects"}}
			objects := func() uint64 { metrics.Read(sample); return sample[0].Value.Uint64() }
			for range b.N {
				for range n {
					if err := s.a.SendNotif(peer, msg); err != nil {
						b.Fatal(err)
					}
				}
				before := objects()
				t0 := time.Now()
				got, err := a.a.Notifs()
				inNotifs += time.Since(t0)
				allocs += objects() - before
				if err != nil || len(got) != n {
					b.Fatal(len(got), err)
				}
			}
			b.ReportMetric(float64(inNotifs.Nanoseconds())/float64(b.N*n), "ns/notif")
			b.ReportMetric(float64(allocs)/float64(b.N), "allocs/Notifs")
		})
	}
}

// libcFunc returns the address of a libc function.
func libcFunc(b *testing.B, name string) uintptr {
	libc, err := purego.Dlopen("libc.so.6", purego.RTLD_NOW|purego.RTLD_GLOBAL)
	if err != nil {
		b.Fatal(err)
	}
	fn, err := purego.Dlsym(libc, name)
	if err != nil {
		b.Fatal(err)
	}
	return fn
}
