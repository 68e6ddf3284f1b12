package metrics

// Kind is a Prometheus metric type.
type Kind string

// Metric kinds.
const (
	Histogram Kind = "histogram"
	Counter   Kind = "counter"
)

// Spec describes one of vLLM's NIXL metrics (NixlPromMetrics in vLLM's
// vllm/distributed/kv_transfer/kv_connector/v1/nixl_connector.py): kvhost
// exports it as "kvhost_" + Name, with vLLM's help text and buckets, so
// dashboards built for vLLM carry over.
type Spec struct {
	Name      string // without prefix, e.g. "nixl_xfer_time_seconds"
	Reference string // vLLM's full name, e.g. "vllm:nixl_xfer_time_seconds"
	Kind      Kind
	Help      string
	Buckets   []float64 // histograms only
	// Observe names the host/pull Observer event that feeds it: "Transfer.Xfer"
	// (seconds), "Transfer.Post" (seconds), "Transfer.Bytes",
	// "Transfer.Descs", "FailedTransfer" or "FailedNotification".
	Observe string
}

// NIXLSpecs returns vLLM's six NIXL metrics, freshly allocated.
func NIXLSpecs() []Spec {
	times := []float64{0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0}
	// 2 KiB to 8 GiB: 2^(10+i) for i = 1, 3, ..., 23.
	var bytes []float64
	for i := 1; i < 25; i += 2 {
		bytes = append(bytes, float64(uint64(1)<<(10+i)))
	}
	descs := []float64{10, 20, 30, 50, 75, 100, 200, 400, 1000, 2000, 4000, 10000, 20000, 50000}
	return []Spec{
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
