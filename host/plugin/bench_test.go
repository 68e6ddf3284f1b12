package plugin

import (
	"context"
	"fmt"
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

// BenchmarkPluginCall measures one plugin call through the host: Xfer.Poll
// of a completed transfer (poll_xfer, with the host's locking and error
// check). Baselines: purego.SyscallN of libc's labs, and a plain Go call.
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
	const chunk = 256
	var host, raw, gocall time.Duration
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
		b.StopTimer()
		for range n {
			r, _, _ := purego.SyscallN(labs, ^uintptr(4))
			sink += r
		}
		t2 := time.Now()
		for i := range n {
			sink += goCall(uintptr(i))
		}
		t3 := time.Now()
		b.StartTimer()
		host += t1.Sub(t0)
		raw += t2.Sub(t1)
		gocall += t3.Sub(t2)
	}
	if sink == 42 {
		b.Log(sink)
	}
	N := float64(b.N)
	b.ReportMetric(float64(host.Nanoseconds())/N, "host-ns/call")
	b.ReportMetric(float64(raw.Nanoseconds())/N, "purego-ns/call")
	b.ReportMetric(float64(gocall.Nanoseconds())/N, "go-ns/call")
	b.ReportMetric(float64(host)/float64(raw), "host/purego")
}

// BenchmarkTransfer1MiB measures a 1 MiB WRITE between two agents of one
// process (post + wait through the host and the fake plugin's worker
// thread) beside two raw copies between the same mmap'd buffers: Go's
// copy() and libc's memcpy (what the fake itself calls), alternating one of
// each. host/copy and host/libc-memcpy are the transfer's rate over theirs;
// host-µs minus plugin-µs (the plugin's own post-to-completion time, from
// telemetry) is what the host adds.
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
			var host, cp, cmem, inPlugin, inPost time.Duration
			b.SetBytes(size)
			b.ReportAllocs()
			// Warm both paths (page faults, worker start).
			for range 3 {
				runBench(b, ctx, x)
				copy(dst.bufs[0], src.bufs[0])
			}
			b.ResetTimer()
			for range b.N {
				t0 := time.Now()
				runBench(b, ctx, x)
				t1 := time.Now()
				b.StopTimer()
				copy(dst.bufs[0], src.bufs[0])
				t2 := time.Now()
				purego.SyscallN(memcpy, uintptr(addr(dst.bufs[0])), uintptr(addr(src.bufs[0])), size)
				t3 := time.Now()
				cmem += t3.Sub(t2)
				if tel, err := x.Telemetry(); err == nil { // where the time went
					inPlugin += tel.Xfer
					inPost += tel.Post
				}
				b.StartTimer()
				host += t1.Sub(t0)
				cp += t2.Sub(t1)
			}
			N := float64(b.N)
			b.ReportMetric(float64(host.Microseconds())/N, "host-µs/xfer")
			b.ReportMetric(float64(inPlugin.Microseconds())/N, "plugin-µs/xfer")
			b.ReportMetric(float64(inPost.Microseconds())/N, "post-µs/xfer")
			b.ReportMetric(float64(cp.Microseconds())/N, "copy-µs")
			b.ReportMetric(float64(cmem.Microseconds())/N, "libc-memcpy-µs")
			b.ReportMetric(size/(host.Seconds()/N)/1e9, "host-GB/s")
			b.ReportMetric(size/(cp.Seconds()/N)/1e9, "copy-GB/s")
			b.ReportMetric(float64(cp)/float64(host), "host/copy")
			b.ReportMetric(float64(cmem)/float64(host), "host/libc-memcpy")
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

// BenchmarkMakeXfer measures building a transfer of n descriptors (the
// per-request cost), through MakePreppedXfer natively and emulated over
// make_batch_xfer, and through MakeBatchXfer natively.
func BenchmarkMakeXfer(b *testing.B) {
	for _, n := range []int{64, 4096} {
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
