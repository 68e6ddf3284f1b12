package metrics

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"strings"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/host/plugin"
	"github.com/kvhost/kvhost/host/pull"
	"github.com/kvhost/kvhost/host/push"
	"github.com/kvhost/kvhost/host/push/rooms"
	"github.com/kvhost/kvhost/host/wire/sglang"
)

// gather returns the metric families of m by name.
func gather(t *testing.T, m *Metrics) map[string]*dto.MetricFamily {
	t.Helper()
	fams, err := m.Registry().Gather()
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]*dto.MetricFamily{}
	for _, f := range fams {
		out[f.GetName()] = f
	}
	return out
}

// value returns the value of the metric of family name whose labels include
// want (a counter's or gauge's value, a histogram's sample count).
func value(t *testing.T, m *Metrics, name string, want map[string]string) float64 {
	t.Helper()
	f := gather(t, m)[name]
	if f == nil {
		t.Fatalf("no metric %s", name)
	}
	for _, x := range f.GetMetric() {
		ok := true
		for k, v := range want {
			found := false
			for _, l := range x.GetLabel() {
				if l.GetName() == k && l.GetValue() == v {
					found = true
				}
			}
			ok = ok && found
		}
		if !ok {
			continue
		}
		switch {
		case x.Counter != nil:
			return x.Counter.GetValue()
		case x.Gauge != nil:
			return x.Gauge.GetValue()
		case x.Histogram != nil:
			return float64(x.Histogram.GetSampleCount())
		}
	}
	t.Fatalf("%s has no metric with labels %v", name, want)
	return 0
}

// The six NIXL metrics have vLLM's kv_connector/v1/nixl_connector.py's help texts and buckets.
func TestReferenceMetricSet(t *testing.T) {
	m := New(map[string]string{"role": "decode"})
	m.ObserveTransfer(3*time.Millisecond, 40*time.Microsecond, 3<<20, 120)
	m.FailedTransfer(nil)
	m.FailedNotification()
	fams := gather(t, m)
	times := []float64{0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0}
	var bytes []float64
	for i := 1; i < 25; i += 2 {
		bytes = append(bytes, float64(uint64(1)<<(10+i)))
	}
	for _, c := range []struct {
		name, help string
		buckets    []float64
		sum        float64
	}{
		{"kvhost_nixl_xfer_time_seconds", "Histogram of transfer duration for NIXL KV Cache transfers.", times[1:], 0.003},
		{"kvhost_nixl_post_time_seconds", "Histogram of transfer post time for NIXL KV Cache transfers.", times, 0.00004},
		{"kvhost_nixl_bytes_transferred", "Histogram of bytes transferred per NIXL KV Cache transfers.", bytes, 3 << 20},
		{"kvhost_nixl_num_descriptors", "Histogram of number of descriptors per NIXL KV Cache transfers.",
			[]float64{10, 20, 30, 50, 75, 100, 200, 400, 1000, 2000, 4000, 10000, 20000, 50000}, 120},
	} {
		f := fams[c.name]
		if f == nil || f.GetType() != dto.MetricType_HISTOGRAM {
			t.Fatalf("%s missing or not a histogram", c.name)
		}
		if f.GetHelp() != c.help {
			t.Errorf("%s help %q", c.name, f.GetHelp())
		}
		h := f.GetMetric()[0].GetHistogram()
		if len(h.GetBucket()) != len(c.buckets) {
			t.Fatalf("%s: %d buckets, want %d", c.name, len(h.GetBucket()), len(c.buckets))
		}
		for i, b := range h.GetBucket() {
			if b.GetUpperBound() != c.buckets[i] {
				t.Errorf("%s bucket %d = %v, want %v", c.name, i, b.GetUpperBound(), c.buckets[i])
			}
		}
		if h.GetSampleCount() != 1 || h.GetSampleSum() != c.sum {
			t.Errorf("%s: count %d sum %v, want 1 and %v", c.name, h.GetSampleCount(), h.GetSampleSum(), c.sum)
		}
		if l := f.GetMetric()[0].GetLabel(); len(l) != 1 || l[0].GetName() != "role" || l[0].GetValue() != "decode" {
			t.Errorf("%s labels %v", c.name, l)
		}
	}
	for name, help := range map[string]string{
		"kvhost_nixl_num_failed_transfers_total":     "Number of failed NIXL KV Cache transfers.",
		"kvhost_nixl_num_failed_notifications_total": "Number of failed NIXL KV Cache notifications.",
	} {
		f := fams[name]
		if f == nil || f.GetType() != dto.MetricType_COUNTER || f.GetHelp() != help || f.GetMetric()[0].GetCounter().GetValue() != 1 {
			t.Errorf("%s: %v", name, f)
		}
	}
}

func TestPluginErrors(t *testing.T) {
	m := New(nil)
	pe := &plugin.Error{Plugin: "fake", Op: "post_xfer", Code: abi.ErrBackend, Message: "injected"}
	m.FailedTransfer(fmt.Errorf("room 7: %w", pe))
	m.FailedTransfer(errors.New("timeout"))
	m.PluginError(nil)
	if v := value(t, m, "kvhost_plugin_errors_total", map[string]string{"op": "post_xfer", "code": "-3"}); v != 1 {
		t.Errorf("plugin errors = %v", v)
	}
	if v := value(t, m, "kvhost_nixl_num_failed_transfers_total", nil); v != 2 {
		t.Errorf("failed transfers = %v", v)
	}
}

func TestPushObserver(t *testing.T) {
	m := New(nil)
	o := m.PushObserver()
	o.Transfer(push.TransferEvent{Room: 1, TransferEvent: plugin.TransferEvent{Bytes: 4096, Descs: 2, Post: time.Microsecond, Xfer: time.Millisecond}})
	o.Transfer(push.TransferEvent{Room: 1, TransferEvent: plugin.TransferEvent{Err: &plugin.Error{Op: "poll_xfer", Code: abi.ErrRemoteDisconnect}}})
	o.Room(push.RoomEvent{Role: push.RolePrefill, Change: rooms.Change{Room: 1, From: sglang.KVPollBootstrapping, To: sglang.KVPollBootstrapping, New: true}})
	o.Room(push.RoomEvent{Role: push.RolePrefill, Change: rooms.Change{Room: 1, From: sglang.KVPollBootstrapping, To: sglang.KVPollWaitingForInput}})
	o.Room(push.RoomEvent{Role: push.RolePrefill, Change: rooms.Change{Room: 1, From: sglang.KVPollWaitingForInput, To: sglang.KVPollWaitingForInput}})
	o.Failure(push.FailureEvent{Role: push.RoleDecode, Room: 2, Remote: true})
	o.Handshake(push.HandshakeEvent{Kind: push.HandshakePeer, Latency: 2 * time.Millisecond})
	o.Handshake(push.HandshakeEvent{Kind: push.HandshakeRoute, Latency: time.Millisecond, Err: errors.New("404")})
	for _, c := range []struct {
		name   string
		labels map[string]string
		want   float64
	}{
		{"kvhost_nixl_xfer_time_seconds", nil, 1},
		{"kvhost_plan_time_seconds", nil, 2}, // failed transfers were planned too
		{"kvhost_nixl_num_failed_transfers_total", nil, 1},
		{"kvhost_plugin_errors_total", map[string]string{"op": "poll_xfer", "code": "-10"}, 1},
		{"kvhost_room_transitions_total", map[string]string{"state": "Bootstrapping"}, 1},
		{"kvhost_room_transitions_total", map[string]string{"state": "WaitingForInput"}, 1},
		{"kvhost_room_failures_total", map[string]string{"origin": "remote"}, 1},
		{"kvhost_handshake_duration_seconds", map[string]string{"kind": "peer_registration", "result": "ok"}, 1},
		{"kvhost_bootstrap_duration_seconds", map[string]string{"step": "route", "result": "error"}, 1},
	} {
		if v := value(t, m, c.name, c.labels); v != c.want {
			t.Errorf("%s%v = %v, want %v", c.name, c.labels, v, c.want)
		}
	}
}

func TestPullObserver(t *testing.T) {
	m := New(nil)
	o := m.PullObserver()
	o.Transfer(pull.TransferStat{Xfer: time.Millisecond, Post: time.Microsecond, Bytes: 1 << 20, Descs: 64})
	o.Transfer(pull.TransferStat{Xfer: time.Millisecond, Post: time.Microsecond, Bytes: 1 << 20, Descs: 64})
	o.FailedTransfer()
	o.FailedNotification()
	o.Handshake(time.Millisecond, nil)
	o.Released(pull.Release{Reason: pull.ReleaseExpired})
	o.BadNotification(pull.NotifMalformed)
	for _, c := range []struct {
		name   string
		labels map[string]string
		want   float64
	}{
		{"kvhost_nixl_bytes_transferred", nil, 2},
		{"kvhost_plan_time_seconds", nil, 2},
		{"kvhost_nixl_num_failed_transfers_total", nil, 1},
		{"kvhost_nixl_num_failed_notifications_total", nil, 1},
		{"kvhost_handshake_duration_seconds", map[string]string{"kind": "vllm_handshake", "result": "ok"}, 1},
		{"kvhost_requests_released_total", map[string]string{"reason": "expired"}, 1},
		{"kvhost_bad_notifications_total", map[string]string{"reason": "malformed"}, 1},
	} {
		if v := value(t, m, c.name, c.labels); v != c.want {
			t.Errorf("%s%v = %v, want %v", c.name, c.labels, v, c.want)
		}
	}
}

func TestRoomSource(t *testing.T) {
	m := New(nil)
	m.SetRoomSource(func(count func(string, int)) {
		count("Transferring", 3)
		count("WaitingForInput", 1)
	})
	if v := value(t, m, "kvhost_rooms", map[string]string{"state": "Transferring"}); v != 3 {
		t.Errorf("rooms = %v", v)
	}
	m.SetRoomSource(nil)
	if f := gather(t, m)["kvhost_rooms"]; f != nil {
		t.Errorf("rooms after removing the source: %v", f)
	}
}

func get(t *testing.T, url string) (int, string) {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

func TestServe(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	m, s, err := Start(ctx, "127.0.0.1:0", map[string]string{"role": "prefill"})
	if err != nil {
		t.Fatal(err)
	}
	base := "http://" + s.Addr()
	if code, body := get(t, base+"/health"); code != http.StatusServiceUnavailable || !strings.Contains(body, "starting") {
		t.Errorf("/health before ready: %d %q", code, body)
	}
	m.SetReady(true)
	if code, body := get(t, base+"/health"); code != http.StatusOK || body != "ok\n" {
		t.Errorf("/health when ready: %d %q", code, body)
	}
	m.ObserveTransfer(7*time.Millisecond, time.Microsecond, 1<<20, 16)
	code, body := get(t, base+"/metrics")
	for _, want := range []string{
		"# HELP kvhost_nixl_xfer_time_seconds Histogram of transfer duration for NIXL KV Cache transfers.",
		`kvhost_nixl_xfer_time_seconds_bucket{role="prefill",le="0.01"} 1`,
		`kvhost_nixl_xfer_time_seconds_bucket{role="prefill",le="0.005"} 0`,
		`kvhost_nixl_num_descriptors_count{role="prefill"} 1`,
		`kvhost_ready{role="prefill"} 1`,
		"go_goroutines",
	} {
		if !strings.Contains(body, want) {
			t.Errorf("/metrics lacks %q", want)
		}
	}
	if code != http.StatusOK {
		t.Errorf("/metrics: %d", code)
	}
	if code, _ := get(t, base+"/nope"); code != http.StatusNotFound {
		t.Errorf("/nope: %d", code)
	}
	// The address is taken now.
	if _, err := Serve(ctx, s.Addr(), m); err == nil {
		t.Error("second server on the same address")
	}
	cancel()
	if err := s.Wait(); err != nil {
		t.Errorf("Wait: %v", err)
	}
	if _, err := http.Get(base + "/health"); err == nil {
		t.Error("server still answers after its context ended")
	}
	if err := s.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
	// No address: metrics without a server.
	m2, s2, err := Start(context.Background(), "", nil)
	if err != nil || m2 == nil || s2 != nil {
		t.Errorf("Start without address: %v %v %v", m2, s2, err)
	}
}

// kvhost_transfer_busy_seconds_total counts overlapping transfers' time
// once, idle gaps and failed transfers not at all.
func TestTransferBusySeconds(t *testing.T) {
	m := New(nil)
	o := m.PullObserver()
	t0 := time.Unix(1000, 0)
	ms := func(n int) time.Duration { return time.Duration(n) * time.Millisecond }
	o.Transfer(pull.TransferStat{Posted: t0, Xfer: ms(3), Bytes: 1})
	o.Transfer(pull.TransferStat{Posted: t0.Add(ms(1)), Xfer: ms(3), Bytes: 1}) // overlaps: +1 ms
	o.Transfer(pull.TransferStat{Posted: t0.Add(ms(10)), Xfer: ms(1), Bytes: 1})
	o.Transfer(pull.TransferStat{Posted: t0.Add(ms(20)), Xfer: ms(5), Err: errors.New("failed")})
	if v := value(t, m, "kvhost_transfer_busy_seconds_total", nil); math.Abs(v-0.005) > 1e-12 {
		t.Fatalf("busy %v s, want 0.005", v)
	}
}
