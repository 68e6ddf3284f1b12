package metrics

import (
	"time"

	"github.com/kvhost/kvhost/host/plugin"
	"github.com/kvhost/kvhost/host/pull"
	"github.com/kvhost/kvhost/host/push"
)

// Transfer is the one adapter of transfer events, push's and pull's alike
// (the completion engine's plugin.TransferEvent): the planning time feeds
// kvhost_plan_time_seconds; a completed transfer the NIXL histograms and
// kvhost_transfer_busy_seconds_total, a
// failed one the failure counter and the plugin error counter.
func (m *Metrics) Transfer(e plugin.TransferEvent) {
	m.ObservePlan(e.Plan)
	if e.Err != nil {
		m.FailedTransfer(e.Err)
		return
	}
	m.ObserveTransfer(e.Xfer, e.Post, e.Bytes, e.Descs)
	m.ObserveInFlight(e.Posted, e.Xfer)
}

// PushObserver adapts m to the push runtime's observer (SGLang style):
// transfers feed kvhost_plan_time_seconds and the NIXL histograms (failed ones the failure counter and
// the plugin error counter), room changes kvhost_room_transitions_total,
// failures kvhost_room_failures_total, bootstrap-server steps
// kvhost_bootstrap_duration_seconds and peer registrations
// kvhost_handshake_duration_seconds{kind="peer_registration"}.
func (m *Metrics) PushObserver() push.Observer { return pushObserver{m} }

type pushObserver struct{ m *Metrics }

func (o pushObserver) Transfer(e push.TransferEvent) { o.m.Transfer(e.TransferEvent) }

func (o pushObserver) Failure(e push.FailureEvent) { o.m.RoomFailed(e.Remote) }

func (o pushObserver) Room(e push.RoomEvent) {
	if e.New || e.From != e.To {
		o.m.RoomEntered(e.To.String())
	}
}

func (o pushObserver) Handshake(e push.HandshakeEvent) {
	switch e.Kind {
	case push.HandshakePeer:
		o.m.Handshake(e.Kind.String(), e.Latency, e.Err)
	default: // register_bootstrap, parallel_info, route, heartbeat
		o.m.Bootstrap(e.Kind.String(), e.Latency, e.Err)
	}
}

// PullObserver adapts m to the pull runtime's observer (vLLM style):
// READs feed the NIXL histograms and counters exactly as vLLM's
// NixlKVConnectorStats does (and kvhost_plan_time_seconds), handshakes
// kvhost_handshake_duration_seconds{kind="vllm_handshake"}, and the
// prefill's releases and unusable notifications their counters.
func (m *Metrics) PullObserver() pull.Observer { return pullObserver{m} }

type pullObserver struct{ m *Metrics }

func (o pullObserver) Transfer(t pull.TransferStat) { o.m.Transfer(t) }
func (o pullObserver) FailedTransfer()              { o.m.FailedTransfer(nil) }
func (o pullObserver) FailedNotification()          { o.m.FailedNotification() }
func (o pullObserver) Handshake(d time.Duration, err error) {
	o.m.Handshake("vllm_handshake", d, err)
}
func (o pullObserver) Released(r pull.Release) { o.m.released.WithLabelValues(string(r.Reason)).Inc() }
func (o pullObserver) BadNotification(r pull.BadNotifReason) {
	o.m.badNotifs.WithLabelValues(string(r)).Inc()
}
