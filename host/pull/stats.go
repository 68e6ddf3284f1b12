package pull

import (
	"math"

	"github.com/kvhost/kvhost/host/plugin"

	"github.com/kvhost/kvhost/host/internal/quantile"
)

// TransferStat is the telemetry of one completed READ, as vLLM's kv_connector/v1/nixl_connector.py
// records it from nixlXferTelemetry (record_transfer): the agent's
// completion engine's transfer event, the one push reports too. Xfer is the
// time from post to completion, Post the time spent inside the call that
// posted it, Bytes the bytes moved, Descs the descriptors of the transfer
// as made, Plan the time spent planning the READ's descriptor ids.
type TransferStat = plugin.TransferEvent

// Stats accumulates transfer statistics the way vLLM's kv_connector/v1/nixl_connector.py's
// NixlKVConnectorStats does: one entry per successful transfer, plus
// failed transfer and failed notification counts. The zero value is empty
// and ready. Stats is a plain value: callers serialise access.
type Stats struct {
	Transfers           []TransferStat
	FailedTransfers     int
	FailedNotifications int
}

// RecordTransfer records a completed transfer.
func (s *Stats) RecordTransfer(t TransferStat) { s.Transfers = append(s.Transfers, t) }

// RecordFailedTransfer records a transfer that failed to be made, posted
// or completed.
func (s *Stats) RecordFailedTransfer() { s.FailedTransfers++ }

// RecordFailedNotification records a notification that could not be sent.
func (s *Stats) RecordFailedNotification() { s.FailedNotifications++ }

// IsEmpty reports whether nothing was recorded. (vLLM's kv_connector/v1/nixl_connector.py looks only
// at successful transfers, so it drops windows holding only failures; here
// they count.)
func (s *Stats) IsEmpty() bool {
	return len(s.Transfers) == 0 && s.FailedTransfers == 0 && s.FailedNotifications == 0
}

// CloneAndReset returns the recorded statistics and empties s.
func (s *Stats) CloneAndReset() Stats {
	old := *s
	*s = Stats{}
	return old
}

// Aggregate adds o's records to s.
func (s *Stats) Aggregate(o Stats) {
	s.Transfers = append(s.Transfers, o.Transfers...)
	s.FailedTransfers += o.FailedTransfers
	s.FailedNotifications += o.FailedNotifications
}

// Summary is vLLM's kv_connector/v1/nixl_connector.py's reduce(): compact statistics for logs. The
// JSON keys are vLLM's kv_connector/v1/nixl_connector.py's; the two failure counts are kvhost's
// addition.
type Summary struct {
	NumSuccessfulTransfers int     `json:"Num successful transfers"`
	AvgXferMs              float64 `json:"Avg xfer time (ms)"`
	P90XferMs              float64 `json:"P90 xfer time (ms)"`
	AvgPostMs              float64 `json:"Avg post time (ms)"`
	P90PostMs              float64 `json:"P90 post time (ms)"`
	AvgMBPerTransfer       float64 `json:"Avg MB per transfer"`
	ThroughputMBs          float64 `json:"Throughput (MB/s)"`
	AvgDescriptors         float64 `json:"Avg number of descriptors"`
	NumFailedTransfers     int     `json:"Num failed transfers"`
	NumFailedNotifications int     `json:"Num failed notifications"`
}

// Reduce computes the Summary: average and p90 (numpy's linear
// interpolation) of transfer and post times in ms, average MB (2^20 bytes)
// per transfer, throughput as total MB over the summed transfer time, and
// average descriptors; times and sizes rounded to 3 decimals, descriptors
// to 1, as vLLM's kv_connector/v1/nixl_connector.py rounds them.
func (s *Stats) Reduce() Summary {
	sum := Summary{NumFailedTransfers: s.FailedTransfers, NumFailedNotifications: s.FailedNotifications}
	n := len(s.Transfers)
	if n == 0 {
		return sum
	}
	xfer := make([]float64, n)
	post := make([]float64, n)
	var totalMB, totalXferS, totalDescs float64
	for i, t := range s.Transfers {
		xfer[i] = t.Xfer.Seconds()
		post[i] = t.Post.Seconds()
		totalMB += float64(t.Bytes) / (1 << 20)
		totalXferS += xfer[i]
		totalDescs += float64(t.Descs)
	}
	sum.NumSuccessfulTransfers = n
	sum.AvgXferMs = round(mean(xfer)*1e3, 3)
	sum.P90XferMs = round(quantile.Percentile(xfer, 90)*1e3, 3)
	sum.AvgPostMs = round(mean(post)*1e3, 3)
	sum.P90PostMs = round(quantile.Percentile(post, 90)*1e3, 3)
	sum.AvgMBPerTransfer = round(totalMB/float64(n), 3)
	if totalXferS > 0 {
		sum.ThroughputMBs = round(totalMB/totalXferS, 3)
	}
	sum.AvgDescriptors = round(totalDescs/float64(n), 1)
	return sum
}

func mean(v []float64) float64 {
	var s float64
	for _, x := range v {
		s += x
	}
	return s / float64(len(v))
}

// round rounds half to even like Python's round(x, digits).
func round(x float64, digits int) float64 {
	p := math.Pow(10, float64(digits))
	return math.RoundToEven(x*p) / p
}
