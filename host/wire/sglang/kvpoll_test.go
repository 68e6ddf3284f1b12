package sglang

import "testing"

// The numbering is SGLang's (base/conn.py) and travels in MORI status
// messages; the names are SGLang's disaggregation/{nixl,mori}/conn.py's.
func TestKVPoll(t *testing.T) {
	for _, c := range []struct {
		p        KVPoll
		n        int
		name     string
		terminal bool
	}{
		{KVPollFailed, 0, "Failed", true},
		{KVPollBootstrapping, 1, "Bootstrapping", false},
		{KVPollWaitingForInput, 2, "WaitingForInput", false},
		{KVPollTransferring, 3, "Transferring", false},
		{KVPollSuccess, 4, "Success", true},
		{KVPoll(9), 9, "KVPoll(9)", false},
	} {
		if int(c.p) != c.n || c.p.String() != c.name || c.p.Terminal() != c.terminal {
			t.Errorf("%d: got %d %q terminal %v, want %d %q %v", c.n, int(c.p), c.p, c.p.Terminal(), c.n, c.name, c.terminal)
		}
	}
}
