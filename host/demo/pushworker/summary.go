package pushworker

import (
	"encoding/json"
	"io"
	"sync"
	"time"

	"github.com/kvhost/kvhost/host/internal/quantile"
	"github.com/kvhost/kvhost/host/internal/schedstat"
	"github.com/kvhost/kvhost/host/internal/span"
	"github.com/kvhost/kvhost/host/push"
)

// Summary is what a worker reports when its workload ends: machine
// readable (JSON) so `kvhost demo` can aggregate the processes' reports.
type Summary struct {
	Role       string   `json:"role"`
	Ranks      []string `json:"ranks"`
	Variant    string   `json:"variant"`
	Completion string   `json:"completion"`
	XferMode   string   `json:"xfer_mode,omitempty"`
	// Checked is false when the run skipped writing and checking bytes
	// (NoBytes); Bytes then counts what moved, unverified.
	Checked bool `json:"checked"`

	Requests int `json:"requests"`
	OK       int `json:"ok"`
	Failed   int `json:"failed"`
	// Aborted counts requests the workload aborts on purpose (they fail on
	// both sides and are expected to).
	Aborted int `json:"aborted"`
	// Unexpected counts failures that are not planned aborts.
	Unexpected int `json:"unexpected_failures"`
	// VerifyErrors counts requests whose bytes decode found wrong.
	VerifyErrors int              `json:"verify_errors"`
	Failures     []RequestFailure `json:"failures,omitempty"` // the first ones

	// Prefill: what its transfers moved. Decode: the KV bytes of the
	// tokens it received (verified when Checked).
	Bytes          uint64  `json:"bytes"`
	Transfers      uint64  `json:"transfers,omitempty"`
	Descriptors    uint64  `json:"descriptors,omitempty"`
	RefDescriptors uint64  `json:"reference_descriptors,omitempty"`
	XferP50us      float64 `json:"xfer_p50_us,omitempty"`
	XferP99us      float64 `json:"xfer_p99_us,omitempty"`
	PostP50us      float64 `json:"post_p50_us,omitempty"`
	// Request latency: prefill, from the first Send to Success; decode,
	// from SendMetadata to Success.
	LatencyP50us float64 `json:"latency_p50_us,omitempty"`
	LatencyP99us float64 `json:"latency_p99_us,omitempty"`

	DurationSec float64 `json:"duration_sec"`
	// GBps is Bytes over DurationSec: the end-to-end rate, which includes
	// filling and checking the synthetic KV.
	GBps float64 `json:"gb_per_sec"`
	// TransferSec is the time the prefill's transfers were in flight (the
	// union of their post-to-completion intervals) and TransferGBps Bytes
	// over it: the rate at which kvhost moved bytes.
	TransferSec  float64 `json:"transfer_sec,omitempty"`
	TransferGBps float64 `json:"transfer_gb_per_sec,omitempty"`
	// Dropped counts malformed or unexpected control messages.
	Dropped int64 `json:"dropped_messages"`
	// Leaked counts rooms of this worker's requests that the runtime still
	// held after every request was closed (must be 0). What peers sent for
	// rooms the worker never opened does not count.
	Leaked int `json:"leaked_rooms"`
	// CPU is what this process's threads did over the requests phase
	// (schedstat: run time and time waiting for a core), set by the kvhost
	// prefill or decode command, where the worker is alone in its process; nil when
	// not measured.
	CPU *schedstat.Usage `json:"cpu,omitempty"`
}

// RequestFailure is one failed request on one rank.
type RequestFailure struct {
	Room   uint64 `json:"room"`
	Rank   string `json:"rank"`
	Reason string `json:"reason"`
	Abort  bool   `json:"planned_abort,omitempty"`
}

// RequestResult is one request's outcome on one worker (all its ranks),
// for the per-request report.
type RequestResult struct {
	Room   uint64 `json:"room"`
	OK     bool   `json:"ok"`
	Reason string `json:"reason,omitempty"`
}

// OKExit reports whether the run is a success: every request either
// succeeded or was a planned abort, and no byte was wrong.
func (s *Summary) OKExit() bool { return s.Unexpected == 0 && s.VerifyErrors == 0 && s.Leaked == 0 }

// WriteJSON writes the summary as one JSON document.
func (s *Summary) WriteJSON(w io.Writer) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(s)
}

const maxListedFailures = 100

// stats is the worker's push.Observer: it aggregates transfers for the
// summary. Safe for concurrent use.
type stats struct {
	push.NopObserver
	mu        sync.Mutex
	transfers uint64
	bytes     uint64
	descs     uint64
	refDescs  uint64
	xfer      []float64 // µs
	post      []float64 // µs
	busy      span.Union
	extra     push.Observer
}

func (s *stats) Transfer(e push.TransferEvent) {
	if s.extra != nil {
		s.extra.Transfer(e)
	}
	if e.Err != nil {
		return
	}
	s.mu.Lock()
	s.transfers++
	s.bytes += e.Bytes
	s.descs += e.Descs
	s.refDescs += e.ReferenceDescs
	s.xfer = append(s.xfer, float64(e.Xfer)/float64(time.Microsecond))
	s.post = append(s.post, float64(e.Post)/float64(time.Microsecond))
	s.busy.Add(e.Posted, e.Posted.Add(e.Xfer))
	s.mu.Unlock()
}

func (s *stats) Failure(e push.FailureEvent) {
	if s.extra != nil {
		s.extra.Failure(e)
	}
}

func (s *stats) Room(e push.RoomEvent) {
	if s.extra != nil {
		s.extra.Room(e)
	}
}

func (s *stats) Handshake(e push.HandshakeEvent) {
	if s.extra != nil {
		s.extra.Handshake(e)
	}
}

// tally aggregates per-request outcomes across a worker's ranks.
type tally struct {
	mu       sync.Mutex
	failures []RequestFailure
	failed   map[uint64]RequestFailure // first failure per room
	verify   map[uint64]bool
	latency  []float64 // µs
	bytes    uint64
}

func newTally() *tally {
	return &tally{failed: map[uint64]RequestFailure{}, verify: map[uint64]bool{}}
}

func (t *tally) fail(f RequestFailure, verify bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if len(t.failures) < maxListedFailures {
		t.failures = append(t.failures, f)
	}
	if _, ok := t.failed[f.Room]; !ok {
		t.failed[f.Room] = f
	}
	if verify {
		t.verify[f.Room] = true
	}
}

func (t *tally) ok(latency time.Duration, bytes uint64) {
	t.mu.Lock()
	t.latency = append(t.latency, float64(latency)/float64(time.Microsecond))
	t.bytes += bytes
	t.mu.Unlock()
}

// result is req's outcome over the worker's ranks so far.
func (t *tally) result(req Request) RequestResult {
	t.mu.Lock()
	defer t.mu.Unlock()
	f, failed := t.failed[req.Room]
	return RequestResult{Room: req.Room, OK: !failed, Reason: f.Reason}
}

// finish fills the request counts of s from the tally.
func (t *tally) finish(s *Summary, reqs []Request, elapsed time.Duration) {
	t.mu.Lock()
	defer t.mu.Unlock()
	s.Requests = len(reqs)
	for _, r := range reqs {
		if _, failed := t.failed[r.Room]; failed {
			s.Failed++
			if r.Abort {
				s.Aborted++
			} else {
				s.Unexpected++
			}
		} else {
			s.OK++
		}
	}
	s.VerifyErrors = len(t.verify)
	s.Failures = t.failures
	s.LatencyP50us = quantile.Percentile(t.latency, 50)
	s.LatencyP99us = quantile.Percentile(t.latency, 99)
	s.DurationSec = elapsed.Seconds()
}
