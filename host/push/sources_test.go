package push

import (
	"net"
	"testing"
)

// TestSources: a prefill rank's messages are accepted from its rank_ip;
// a rank on this host also from the other addresses any local process can
// use (a loopback rank_ip: this host's addresses; a host address: any
// loopback address); another host's rank, and another loopback address
// than a loopback rank_ip, are refused.
func TestSources(t *testing.T) {
	ip := net.ParseIP
	host := []net.IP{ip("192.0.2.2"), ip("2001:db8::2")}
	cases := []struct {
		rank string
		from string
		ok   bool
	}{
		{"127.0.0.1", "127.0.0.1", true},
		{"127.0.0.1", "192.0.2.2", true},
		{"127.0.0.1", "2001:db8::2", true},
		{"127.0.0.1", "127.0.0.2", false},
		{"127.0.0.1", "192.0.2.9", false},
		{"192.0.2.2", "192.0.2.2", true},
		{"192.0.2.2", "127.0.0.1", true},
		{"192.0.2.2", "::1", true},
		{"192.0.2.2", "192.0.2.3", false},
		{"192.0.2.9", "192.0.2.9", true},
		{"192.0.2.9", "127.0.0.1", false},
		{"192.0.2.9", "192.0.2.2", false},
		{"::1", "::1", true},
		{"::1", "127.0.0.1", false},
		{"10.0.0.5", "::ffff:10.0.0.5", true},
	}
	for _, c := range cases {
		tg := target{src: sourcesOf([]net.IP{ip(c.rank)}, host)}
		if got := tg.sentFrom(&net.TCPAddr{IP: ip(c.from), Port: 5}); got != c.ok {
			t.Errorf("rank_ip %s, message from %s: accepted %v, want %v", c.rank, c.from, got, c.ok)
		}
	}
	if (&target{src: sourcesOf([]net.IP{ip("127.0.0.1")}, host)}).sentFrom(&net.UnixAddr{Name: "x"}) {
		t.Error("a message from a non-TCP address was accepted")
	}
}
