package pull

import "time"

// Observer receives the runtime's events as they happen, for metrics. Its
// methods are called from the runtime's goroutines (several at once) and
// must be fast and safe for concurrent use. Embed NopObserver to implement
// only some of them.
type Observer interface {
	// Transfer: a READ completed (decode).
	Transfer(TransferStat)
	// FailedTransfer: a READ could not be made or posted, failed, or timed
	// out (decode).
	FailedTransfer()
	// FailedNotification: a notification-only message could not be sent
	// (decode, full prefix hit).
	FailedNotification()
	// Handshake: a handshake with a remote engine finished, err nil on
	// success (decode). d covers fetch, decode, validation and list prep.
	Handshake(d time.Duration, err error)
	// Released: the prefill freed a held request (prefill).
	Released(Release)
	// BadNotification: the prefill got a notification it cannot use: for
	// an unknown or already released request, or malformed (prefill).
	BadNotification(reason BadNotifReason)
}

// BadNotifReason says why a prefill ignored a notification.
type BadNotifReason string

// Reasons a notification is ignored.
const (
	// NotifUnknown names a request the prefill does not hold: never held,
	// already released (for example expired), or a surplus notification.
	NotifUnknown BadNotifReason = "unknown_request"
	// NotifMalformed is not "{request_id}:{count}".
	NotifMalformed BadNotifReason = "malformed"
)

// NopObserver ignores every event.
type NopObserver struct{}

func (NopObserver) Transfer(TransferStat)            {}
func (NopObserver) FailedTransfer()                  {}
func (NopObserver) FailedNotification()              {}
func (NopObserver) Handshake(time.Duration, error)   {}
func (NopObserver) Released(Release)                 {}
func (NopObserver) BadNotification(r BadNotifReason) {}

// MetricKind is a Prometheus metric type.
type MetricKind string

// Metric kinds.
const (
	Histogram MetricKind = "histogram"
	Counter   MetricKind = "counter"
)

// MetricSpec describes one of the reference's NIXL metrics (NixlPromMetrics):
// kvhost exports it as "kvhost_" + Name, with the reference's help text and
// buckets, so dashboards built for vLLM carry over.
type MetricSpec struct {
	Name      string // without prefix, e.g. "nixl_xfer_time_seconds"
	Reference string // the reference's full name, e.g. "vllm:nixl_xfer_time_seconds"
	Kind      MetricKind
	Help      string
	Buckets   []float64 // histograms only
	// Observe names the Observer event that feeds it: "Transfer.Xfer"
	// (seconds), "Transfer.Post" (seconds), "Transfer.Bytes",
	// "Transfer.Descs", "FailedTransfer" or "FailedNotification".
	Observe string
}

// MetricSpecs returns the reference's six NIXL metrics, freshly allocated.
func MetricSpecs() []MetricSpec {
	times := []float64{0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0}
	// 2 KiB to 8 GiB: 2^(10+i) for i = 1, 3, ..., 23.
	var bytes []float64
	for i := 1; i < 25; i += 2 {
		bytes = append(bytes, float64(uint64(1)<<(10+i)))
	}
	descs := []float64{10, 20, 30, 50, 75, 100, 200, 400, 1000, 2000, 4000, 10000, 20000, 50000}
	return []MetricSpec{
		{Name: "nixl_xfer_time_seconds", Reference: "vllm:nixl_xfer_time_seconds", Kind: Histogram,
			Help:    "Histogram of transfer duration for NIXL KV Cache transfers.",
			Buckets: times[1:], Observe: "Transfer.Xfer"},
		{Name: "nixl_post_time_seconds", Reference: "vllm:nixl_post_time_seconds", Kind: Histogram,
			Help:    "Histogram of transfer post time for NIXL KV Cache transfers.",
			Buckets: times, Observe: "Transfer.Post"},
		{Name: "nixl_bytes_transferred", Reference: "vllm:nixl_bytes_transferred", Kind: Histogram,
			Help:    "Histogram of bytes transferred per NIXL KV Cache transfers.",
			Buckets: bytes, Observe: "Transfer.Bytes"},
		{Name: "nixl_num_descriptors", Reference: "vllm:nixl_num_descriptors", Kind: Histogram,
			Help:    "Histogram of number of descriptors per NIXL KV Cache transfers.",
			Buckets: descs, Observe: "Transfer.Descs"},
		{Name: "nixl_num_failed_transfers", Reference: "vllm:nixl_num_failed_transfers", Kind: Counter,
			Help: "Number of failed NIXL KV Cache transfers.", Observe: "FailedTransfer"},
		{Name: "nixl_num_failed_notifications", Reference: "vllm:nixl_num_failed_notifications", Kind: Counter,
			Help: "Number of failed NIXL KV Cache notifications.", Observe: "FailedNotification"},
	}
}
