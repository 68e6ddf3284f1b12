package push_test

import (
	"context"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvhost/kvhost/host/plugin"
)

// rssBytes is the process's resident set (Go heap and the plugin's C
// memory alike).
func rssBytes(t *testing.T) uint64 {
	b, err := os.ReadFile("/proc/self/statm")
	if err != nil {
		t.Fatalf("reading /proc/self/statm: %v", err)
	}
	f := strings.Fields(string(b))
	pages, _ := strconv.ParseUint(f[1], 10, 64)
	return pages * uint64(os.Getpagesize())
}

func heapInuse() uint64 {
	runtime.GC()
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return ms.HeapInuse
}

// soakRooms is how many rooms TestManyRoomsFlatMemory runs: 10k, fewer
// under the race detector (KVHOST_SOAK=1 restores 10k).
func soakRooms() int {
	if raceEnabled && os.Getenv("KVHOST_SOAK") == "" {
		return 3000
	}
	return 10000
}

// TestManyRoomsFlatMemory runs many rooms through one prefill and one
// decode rank and checks that nothing accumulates: no room, transfer info
// or receiver left, Go heap and process RSS (plugin handles live in C
// memory) flat between the first fifth and the end.
func TestManyRoomsFlatMemory(t *testing.T) {
	for _, c := range []struct {
		name   string
		params []plugin.Param
	}{{"notif", nil}, {"status", []plugin.Param{{Key: "caps_off", Value: "notif"}}}} {
		t.Run(c.name, func(t *testing.T) {
			r := newRig(t, rigOpts{pparams: c.params, dparams: c.params})
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
			defer cancel()
			total := soakRooms()
			const conc = 16
			run := func(from, to int) {
				var wg sync.WaitGroup
				next := make(chan int)
				for w := 0; w < conc; w++ {
					wg.Add(1)
					go func() {
						defer wg.Done()
						for i := range next {
							q := r.prepare(uint64(1_000_000+i), 1+i%8, w)
							if err := r.transfer(ctx, q); err != nil {
								t.Error(err)
							}
							q.close()
						}
					}()
				}
				for i := from; i < to && !t.Failed(); i++ {
					next <- i
				}
				close(next)
				wg.Wait()
			}
			start := time.Now()
			warm := total / 5
			run(0, warm)
			heap0, rss0, g0 := heapInuse(), rssBytes(t), runtime.NumGoroutine()
			run(warm, total)
			heap1, rss1, g1 := heapInuse(), rssBytes(t), runtime.NumGoroutine()
			took := time.Since(start)
			if t.Failed() {
				return
			}
			if n := r.pf.Rooms() + r.pf.Pending() + r.dec.Rooms(); n != 0 {
				t.Fatalf("%d rooms left after %d", n, total)
			}
			t.Logf("%d rooms in %v (%.0f rooms/s): heap %d -> %d KiB, RSS %d -> %d KiB, goroutines %d -> %d",
				total, took, float64(total)/took.Seconds(), heap0>>10, heap1>>10, rss0>>10, rss1>>10, g0, g1)
			if heap1 > heap0+4<<20 {
				t.Errorf("Go heap grew by %d KiB over %d rooms", (heap1-heap0)>>10, total-warm)
			}
			if rss1 > rss0+24<<20 {
				t.Errorf("RSS grew by %d KiB over %d rooms", (rss1-rss0)>>10, total-warm)
			}
			if g1 > g0+4 {
				t.Errorf("goroutines grew from %d to %d", g0, g1)
			}
		})
	}
}
