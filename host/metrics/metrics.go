// Package metrics exposes a kvhost worker's transfer statistics to
// Prometheus and answers health checks.
//
// # Metric set
//
// The six NIXL metrics of vLLM's NixlPromMetrics, under a kvhost_ prefix
// and with vLLM's help texts and buckets (NIXLSpecs is the one list of
// them), so dashboards built for vLLM carry over by
// replacing "vllm:" with "kvhost_":
//
//	kvhost_nixl_xfer_time_seconds               histogram  post to completion
//	kvhost_nixl_post_time_seconds               histogram  inside post
//	kvhost_nixl_bytes_transferred               histogram  bytes per transfer
//	kvhost_nixl_num_descriptors                 histogram  descriptors per transfer
//	kvhost_nixl_num_failed_transfers_total      counter
//	kvhost_nixl_num_failed_notifications_total  counter
//
// (Python's prometheus_client exposes a counter named x as x_total; so do
// these.) kvhost adds:
//
//	kvhost_room_transitions_total{state}         counter  rooms entering each KVPoll state
//	kvhost_rooms{state}                          gauge    rooms held now, by state (when the
//	                                                      worker sets a RoomSource)
//	kvhost_room_failures_total{origin}           counter  failed rooms: origin local or remote
//	kvhost_handshake_duration_seconds{kind,result}  histogram  peer handshakes
//	kvhost_bootstrap_duration_seconds{step,result}  histogram  bootstrap-server calls
//	kvhost_plan_time_seconds                     histogram  planning a transfer's descriptors
//	                                                      (strided copies or prepped indices)
//	kvhost_plugin_errors_total{op,code}          counter  plugin errors, by ABI function and status
//	kvhost_requests_released_total{reason}       counter  pull prefill: held requests freed
//	kvhost_bad_notifications_total{reason}       counter  pull prefill: unusable notifications
//	kvhost_ready                                 gauge    1 once the worker serves
//	kvhost_transfer_busy_seconds_total           counter  time at least one transfer was in
//	                                                      flight: the union of the transfers'
//	                                                      post-to-completion intervals, as
//	                                                      kvhost demo's transfer rate counts it
//	                                                      (host/internal/span); with
//	                                                      kvhost_nixl_bytes_transferred_sum, the
//	                                                      rate at which the worker moved bytes
//
// Every metric carries the constant labels given to New: a worker process
// passes its role ("prefill" or "decode") and whatever identifies it (engine
// id, rank). One Metrics serves one worker; a process hosting several
// workers (kvhost demo --in-process) makes one per worker.
//
// # Feeding it
//
// The runtimes report events through their observer interfaces;
// PushObserver and PullObserver adapt a Metrics to them. Anything else can
// call the Observe* methods. All methods are safe for concurrent use and
// cheap (no allocation on the transfer path).
//
// # Serving
//
// Handler serves /metrics and /health; Serve listens on an address until
// its context ends. /health answers 200 "ok" once SetReady(true) was called
// and 503 before, so an orchestrator waits for the worker's registration.
package metrics

import (
	"errors"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"

	"github.com/kvhost/kvhost/host/internal/span"
	"github.com/kvhost/kvhost/host/plugin"
)

// Prefix starts every kvhost metric name.
const Prefix = "kvhost_"

// latencyBuckets are the buckets of the handshake and bootstrap
// histograms: 0.5 ms to about 16 s, doubling.
var latencyBuckets = prometheus.ExponentialBuckets(0.0005, 2, 16)

// planBuckets are the buckets of kvhost_plan_time_seconds: 1 us to about
// 0.5 s, doubling (a chunk of a few pages plans in microseconds, a
// 4096-page chunk of a 61-layer model in about a millisecond).
var planBuckets = prometheus.ExponentialBuckets(1e-6, 2, 20)

// Metrics is the metric set of one worker process, in its own registry.
type Metrics struct {
	reg *prometheus.Registry

	xferTime, postTime, bytes, descs  prometheus.Histogram
	planTime                          prometheus.Histogram
	failedXfers, failedNotifs         prometheus.Counter
	roomTransitions, roomFailures     *prometheus.CounterVec
	handshake, bootstrap              *prometheus.HistogramVec
	pluginErrors, released, badNotifs *prometheus.CounterVec
	ready                             prometheus.Gauge
	isReady                           atomic.Bool
	busySeconds                       prometheus.Counter

	busyMu sync.Mutex
	busy   span.Running // feeds busySeconds

	mu     sync.Mutex
	source RoomSource // nil: kvhost_rooms is absent
}

// RoomSource reports the rooms a worker holds now: fn is called at every
// scrape with a function to call once per state with its count.
type RoomSource func(count func(state string, n int))

// New returns a metric set whose metrics all carry constLabels (nil for
// none), with Go runtime and process collectors beside them.
func New(constLabels prometheus.Labels) *Metrics {
	m := &Metrics{reg: prometheus.NewRegistry()}
	specs := map[string]Spec{}
	for _, s := range NIXLSpecs() {
		specs[s.Name] = s
	}
	hist := func(name string) prometheus.Histogram {
		s := specs[name]
		return prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: Prefix + s.Name, Help: s.Help, Buckets: s.Buckets, ConstLabels: constLabels})
	}
	counter := func(name string) prometheus.Counter {
		s := specs[name]
		return prometheus.NewCounter(prometheus.CounterOpts{
			Name: Prefix + s.Name + "_total", Help: s.Help, ConstLabels: constLabels})
	}
	m.xferTime = hist("nixl_xfer_time_seconds")
	m.postTime = hist("nixl_post_time_seconds")
	m.bytes = hist("nixl_bytes_transferred")
	m.descs = hist("nixl_num_descriptors")
	m.planTime = prometheus.NewHistogram(prometheus.HistogramOpts{
		Name: Prefix + "plan_time_seconds", Buckets: planBuckets, ConstLabels: constLabels,
		Help: "Time spent planning a transfer's descriptors (strided copies or prepped indices) before it is made."})
	m.failedXfers = counter("nixl_num_failed_transfers")
	m.failedNotifs = counter("nixl_num_failed_notifications")
	counterVec := func(name, help string, labels ...string) *prometheus.CounterVec {
		return prometheus.NewCounterVec(prometheus.CounterOpts{Name: Prefix + name, Help: help, ConstLabels: constLabels}, labels)
	}
	latencyVec := func(name, help string, labels ...string) *prometheus.HistogramVec {
		return prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: Prefix + name, Help: help, Buckets: latencyBuckets, ConstLabels: constLabels}, labels)
	}
	m.roomTransitions = counterVec("room_transitions_total",
		"Rooms (requests) entering each KVPoll state.", "state")
	m.roomFailures = counterVec("room_failures_total",
		"Rooms (requests) that failed, by where the failure was detected (local, or remote: reported by the peer).", "origin")
	m.handshake = latencyVec("handshake_duration_seconds",
		"Duration of handshakes with peer workers (metadata exchange, loading, list preparation), by kind and result.", "kind", "result")
	m.bootstrap = latencyVec("bootstrap_duration_seconds",
		"Duration of calls to the bootstrap server (registration, parallel info, route lookup, heartbeat), by step and result.", "step", "result")
	m.pluginErrors = counterVec("plugin_errors_total",
		"Errors returned by the transfer plugin, by ABI function and status code.", "op", "code")
	m.released = counterVec("requests_released_total",
		"Requests a pull-style prefill stopped holding, by reason (notified, expired, aborted).", "reason")
	m.badNotifs = counterVec("bad_notifications_total",
		"Notifications a pull-style prefill could not use, by reason.", "reason")
	m.ready = prometheus.NewGauge(prometheus.GaugeOpts{
		Name: Prefix + "ready", ConstLabels: constLabels,
		Help: "1 once the worker is registered and serving, else 0.",
	})
	m.busySeconds = prometheus.NewCounter(prometheus.CounterOpts{
		Name: Prefix + "transfer_busy_seconds_total", ConstLabels: constLabels,
		Help: "Time at least one transfer was in flight: the union of completed transfers' post-to-completion intervals."})
	m.reg.MustRegister(m.busySeconds, m.xferTime, m.postTime, m.bytes, m.descs, m.planTime, m.failedXfers, m.failedNotifs,
		m.roomTransitions, m.roomFailures, m.handshake, m.bootstrap, m.pluginErrors, m.released,
		m.badNotifs, m.ready, &roomCollector{m: m, desc: prometheus.NewDesc(Prefix+"rooms",
			"Rooms (requests) the worker holds now, by KVPoll state.", []string{"state"}, constLabels)},
		collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return m
}

// Registry returns the registry holding the metrics (to add more, or to
// gather them in tests).
func (m *Metrics) Registry() *prometheus.Registry { return m.reg }

// ObserveTransfer records one completed transfer: post to completion time,
// time inside post, bytes and descriptors (record_transfer).
func (m *Metrics) ObserveTransfer(xfer, post time.Duration, bytes, descs uint64) {
	m.xferTime.Observe(xfer.Seconds())
	m.postTime.Observe(post.Seconds())
	m.bytes.Observe(float64(bytes))
	m.descs.Observe(float64(descs))
}

// ObserveInFlight adds a completed transfer's post-to-completion interval
// to kvhost_transfer_busy_seconds_total (span.Running: call it as
// transfers complete).
func (m *Metrics) ObserveInFlight(posted time.Time, xfer time.Duration) {
	m.busyMu.Lock()
	grew := m.busy.Add(posted, posted.Add(xfer))
	m.busyMu.Unlock()
	if grew > 0 {
		m.busySeconds.Add(grew.Seconds())
	}
}

// ObservePlan records the time spent planning one transfer's descriptors.
func (m *Metrics) ObservePlan(d time.Duration) { m.planTime.Observe(d.Seconds()) }

// FailedTransfer counts a transfer that could not be made or posted, failed
// or timed out. A plugin error in err is also counted by ABI function and
// code (err may be nil).
func (m *Metrics) FailedTransfer(err error) {
	m.failedXfers.Inc()
	m.PluginError(err)
}

// FailedNotification counts a notification that could not be sent.
func (m *Metrics) FailedNotification() { m.failedNotifs.Inc() }

// PluginError counts err by ABI function and status code if it is (or
// wraps) a *plugin.Error; other errors and nil are ignored.
func (m *Metrics) PluginError(err error) {
	var pe *plugin.Error
	if errors.As(err, &pe) {
		m.pluginErrors.WithLabelValues(pe.Op, strconv.Itoa(int(pe.Code))).Inc()
	}
}

// Handshake records a handshake with a peer of the given kind.
func (m *Metrics) Handshake(kind string, d time.Duration, err error) {
	m.handshake.WithLabelValues(kind, result(err)).Observe(d.Seconds())
}

// Bootstrap records a call to the bootstrap server.
func (m *Metrics) Bootstrap(step string, d time.Duration, err error) {
	m.bootstrap.WithLabelValues(step, result(err)).Observe(d.Seconds())
}

func result(err error) string {
	if err != nil {
		return "error"
	}
	return "ok"
}

// RoomEntered counts a room entering state (a KVPoll name).
func (m *Metrics) RoomEntered(state string) {
	m.roomTransitions.WithLabelValues(state).Inc()
}

// RoomFailed counts a failed room; remote is true when the peer reported it.
func (m *Metrics) RoomFailed(remote bool) {
	origin := "local"
	if remote {
		origin = "remote"
	}
	m.roomFailures.WithLabelValues(origin).Inc()
}

// SetRoomSource makes kvhost_rooms report what fn counts at each scrape
// (nil removes it). fn must name each state at most once.
func (m *Metrics) SetRoomSource(fn RoomSource) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.source = fn
}

// SetReady marks the worker ready (or not) for /health and kvhost_ready.
func (m *Metrics) SetReady(ready bool) {
	m.isReady.Store(ready)
	if ready {
		m.ready.Set(1)
	} else {
		m.ready.Set(0)
	}
}

// Ready reports what SetReady last set.
func (m *Metrics) Ready() bool { return m.isReady.Load() }

// roomCollector turns the RoomSources into kvhost_rooms at scrape time.
type roomCollector struct {
	m    *Metrics
	desc *prometheus.Desc
}

func (c *roomCollector) Describe(ch chan<- *prometheus.Desc) { ch <- c.desc }

func (c *roomCollector) Collect(ch chan<- prometheus.Metric) {
	c.m.mu.Lock()
	fn := c.m.source
	c.m.mu.Unlock()
	if fn != nil {
		fn(func(state string, n int) {
			ch <- prometheus.MustNewConstMetric(c.desc, prometheus.GaugeValue, float64(n), state)
		})
	}
}
