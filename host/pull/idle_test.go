package pull

import (
	"os"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/kvhost/kvhost/host/plugin"
)

// processCPU is the process's user+system CPU time.
func processCPU(t *testing.T) time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		t.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// cpuShare is the share of a core the process used over d.
func cpuShare(t *testing.T, d time.Duration) float64 {
	c0, t0 := processCPU(t), time.Now()
	time.Sleep(d)
	return float64(processCPU(t)-c0) / float64(time.Since(t0))
}

// An idle prefill (a Sender holding nothing) and an idle decode rank (a
// Receiver with nothing in flight) cost at most 1% of a core together,
// with the agents' event descriptors and with polling. Before the
// completion engine the Sender polled notifications every 2ms whatever it
// held. KVHOST_IDLE_SECONDS sets the measuring time (default 1).
func TestIdleWorkersCPU(t *testing.T) {
	secs := 1.0
	if v, err := strconv.ParseFloat(os.Getenv("KVHOST_IDLE_SECONDS"), 64); err == nil && v > 0 {
		secs = v
	}
	d := time.Duration(secs * float64(time.Second))
	g := geom{hnd: true, layers: 2, heads: 2, headBytes: 64, tp: 1, blockSize: 4, blocks: 16}
	for _, c := range []struct {
		name   string
		params []plugin.Param
	}{{"default", nil}, {"polling", []plugin.Param{{Key: "caps_off", Value: "event_fd"}}}} {
		t.Run(c.name, func(t *testing.T) {
			base := cpuShare(t, d)
			newPrefillSide(t, g, "prefill-idle", func(cfg *SenderConfig) {
				if c.params != nil {
					cfg.Ranks[0].Agent = newAgent(t, "pidle", c.params...)
				}
			})
			newDecodeSide(t, g, nil, c.params...)
			time.Sleep(100 * time.Millisecond)
			// Whatever else the machine (or this process: the race
			// detector, other tests' goroutines winding down) does can
			// only add CPU time, never take it away, so the least of a few
			// samples is the workers' own cost; a worker that really spins
			// costs more than 1% in every sample.
			got := cpuShare(t, d)
			for i := 1; i < 5 && got-base > 0.01; i++ {
				got = min(got, cpuShare(t, d))
			}
			t.Logf("%s: idle prefill and decode cost %.3f%% of a core (process before them %.3f%%)", c.name, 100*got, 100*base)
			if got-base > 0.01 {
				t.Errorf("idle workers cost %.2f%% of a core, want at most 1%%", 100*(got-base))
			}
		})
	}
}
