package conformance

import (
	"os/exec"
	"strings"
	"testing"
	"time"
)

// A helper that never answers is killed after answerWithin: the suite
// fails instead of hanging.
func TestHelperThatDoesNotAnswerIsKilled(t *testing.T) {
	sleep, err := exec.LookPath("sleep")
	if err != nil {
		t.Fatalf("no sleep command: %v", err)
	}
	start := time.Now()
	_, err = startHelper(exec.Command(sleep, "60"), "fake", nil, 200*time.Millisecond)
	if err == nil || !strings.Contains(err.Error(), "killed") {
		t.Fatalf("startHelper with a silent helper: %v, want it killed", err)
	}
	if d := time.Since(start); d > 20*time.Second {
		t.Errorf("it took %v to give up on the helper", d)
	}
}
