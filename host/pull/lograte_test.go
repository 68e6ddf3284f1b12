package pull

import (
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/kvhost/kvhost/host/internal/ratelog/ratelogtest"
)

// A decode sending 200,000 notifications for requests the prefill does
// not hold makes it write a bounded number of log lines (it wrote one
// each: 65 MB in under 10 s), and what was not written is counted in a
// line of its own.
func TestUnknownNotificationFloodIsRateLimited(t *testing.T) {
	const notifs, maxLines = 200000, 200
	var out ratelogtest.LineCounter
	g := geom{hnd: true, layers: 2, heads: 2, headBytes: 16, tp: 1, blockSize: 4, blocks: 8}
	ps := newPrefillSide(t, g, "P", func(c *SenderConfig) { c.Logger = slog.New(slog.NewTextHandler(&out, nil)) })
	n := newNotifier(t, ps)
	start := time.Now()
	for i := range notifs {
		n.send(t, 0, fmt.Sprintf("unknown-%d:1", i))
	}
	eventually(t, "every notification", time.Minute, func() bool { return ps.sender.Counts().UnknownNotifications == notifs })
	elapsed := time.Since(start)
	if err := ps.sender.Close(); err != nil {
		t.Fatal(err)
	}
	lines, last := out.Count()
	t.Logf("%d unknown notifications in %v: %d log lines", notifs, elapsed, lines)
	if lines > maxLines {
		t.Fatalf("%d log lines for %d unknown notifications, want at most %d", lines, notifs, maxLines)
	}
	if !strings.Contains(last, "suppressed") {
		t.Fatalf("the suppressed lines were not reported; last line %q", last)
	}
}
