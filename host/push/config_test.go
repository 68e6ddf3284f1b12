package push

import (
	"testing"
	"time"

	"github.com/kvhost/kvhost/abi"
)

func TestParseSeconds(t *testing.T) {
	for in, want := range map[string]time.Duration{"300": 300 * time.Second, "2.5": 2500 * time.Millisecond, "90s": 90 * time.Second, "500ms": 500 * time.Millisecond, " 0 ": 0} {
		got, err := ParseSeconds(in, time.Second)
		if err != nil || got != want {
			t.Errorf("ParseSeconds(%q) = %v, %v; want %v", in, got, err, want)
		}
	}
	for _, in := range []string{"", "-1", "abc", "-5s", "1e300"} {
		if _, err := ParseSeconds(in, time.Second); err == nil {
			t.Errorf("ParseSeconds(%q) accepted", in)
		}
	}
	if d, _ := ParseSeconds("250", time.Millisecond); d != 250*time.Millisecond {
		t.Errorf("ms unit: %v", d)
	}
	var s Seconds
	if err := s.Set("600"); err != nil || s.D != 10*time.Minute || s.String() != "10m0s" {
		t.Errorf("Seconds flag: %v %v", s.D, err)
	}
}

func TestLoadEnv(t *testing.T) {
	env := map[string]string{
		"SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT":     "600",
		"KVHOST_WAITING_TIMEOUT":                      "45s",
		"SGLANG_DISAGGREGATION_WAITING_TIMEOUT":       "999", // the kvhost name wins
		"SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL":    "3",
		"SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": "5",
		"SGLANG_DISAGGREGATION_QUEUE_SIZE":            "8",
		"SGLANG_MORI_TRANSFER_TIMEOUT_MS":             "1500",
		"SGLANG_MORI_SEND_AUX_RDMA":                   "true",
	}
	lookup := func(k string) (string, bool) { v, ok := env[k]; return v, ok }
	var s Settings
	if err := s.LoadEnv(lookup, nil); err != nil {
		t.Fatal(err)
	}
	want := Settings{BootstrapTimeout: 600 * time.Second, WaitingTimeout: 45 * time.Second, HeartbeatInterval: 3 * time.Second,
		HeartbeatMaxFailures: 5, QueueSize: 8, TransferTimeout: 1500 * time.Millisecond, MORIAuxRDMA: true}
	if s != want {
		t.Fatalf("got %+v\nwant %+v", s, want)
	}
	bad := Settings{}
	if err := bad.LoadEnv(func(k string) (string, bool) {
		if k == "SGLANG_DISAGGREGATION_QUEUE_SIZE" {
			return "many", true
		}
		return "", false
	}, nil); err == nil {
		t.Fatal("a bad value was accepted")
	}
	d := Settings{}.withDefaults()
	if d.BootstrapTimeout != 300*time.Second || d.WaitingTimeout != 300*time.Second || d.HeartbeatInterval != 5*time.Second ||
		d.HeartbeatMaxFailures != 2 || d.QueueSize != 4 || d.TransferTimeout != 0 {
		t.Fatalf("reference defaults: %+v", d)
	}
}

// TestResolveXfer: auto takes strided batch transfers where the agent has
// native strides, else prepped lists where it has them natively (NIXL
// variant), else batch transfers of plain descriptors; explicit modes stay.
func TestResolveXfer(t *testing.T) {
	all := abi.CapPrepped | abi.CapBatch | abi.CapStrided
	for _, c := range []struct {
		v    Variant
		x    XferMode
		caps abi.Caps
		want XferMode
		err  bool
	}{
		{VariantNIXL, XferAuto, all, XferBatch, false},
		{VariantNIXL, XferAuto, abi.CapPrepped, XferPrepped, false},
		{VariantNIXL, XferAuto, abi.CapPrepped | abi.CapBatch, XferPrepped, false},
		{VariantNIXL, XferAuto, abi.CapBatch | abi.CapStrided, XferBatch, false},
		{VariantNIXL, XferAuto, abi.CapBatch, XferBatch, false},
		{VariantMORI, XferAuto, all, XferBatch, false},
		{VariantNIXL, XferBatch, all, XferBatch, false},
		{VariantNIXL, XferPrepped, abi.CapBatch, XferPrepped, false}, // emulated lists, as asked
		{VariantMORI, XferPrepped, all, 0, true},
	} {
		got, err := resolveXfer(c.v, c.x, c.caps)
		if (err != nil) != c.err || got != c.want {
			t.Errorf("%v %v caps %v: %v, %v; want %v (error %v)", c.v, c.x, c.caps.Names(), got, err, c.want, c.err)
		}
	}
	for s, want := range map[string]XferMode{"": XferAuto, "auto": XferAuto, "batch": XferBatch, "Prepped": XferPrepped} {
		if got, err := ParseXferMode(s); err != nil || got != want {
			t.Errorf("ParseXferMode(%q) = %v, %v; want %v", s, got, err, want)
		}
	}
}
