package pushworker

import (
	"testing"
	"time"

	"github.com/kvhost/kvhost/host/plugin"
	"github.com/kvhost/kvhost/host/push"
)

// The prefill's in-flight time is the union of its transfers' intervals:
// overlapping transfers count once, gaps not at all.
func TestStatsInFlightTime(t *testing.T) {
	var st stats
	t0 := time.Unix(100, 0)
	for _, iv := range [][2]int{{0, 10}, {5, 15}, {30, 40}} { // ms
		st.Transfer(push.TransferEvent{TransferEvent: plugin.TransferEvent{Bytes: 1,
			Posted: t0.Add(time.Duration(iv[0]) * time.Millisecond), Xfer: time.Duration(iv[1]-iv[0]) * time.Millisecond}})
	}
	if got, want := st.busy.Total(), 25*time.Millisecond; got != want {
		t.Fatalf("in flight %v, want %v", got, want)
	}
}
