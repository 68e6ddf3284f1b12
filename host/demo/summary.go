package demo

import (
	"encoding/json"
	"fmt"
	"io"
	"sort"
	"strings"

	"github.com/kvhost/kvhost/host/demo/pullworker"
	"github.com/kvhost/kvhost/host/demo/pushworker"
	"github.com/kvhost/kvhost/host/internal/schedstat"
	"github.com/kvhost/kvhost/host/internal/span"
)

// Summary is what a demo run reports. Rates are GB/s (1e9 bytes/s).
type Summary struct {
	Style     string `json:"style"`
	Attention string `json:"attention"`
	Plugin    string `json:"plugin"`
	MemKinds  string `json:"mem_kinds"` // what the KV pools were registered as: vram, dram or mixed
	PrefillTP int    `json:"prefill_tp"`
	DecodeTP  int    `json:"decode_tp"`
	// Processes is how many processes ran workers (and the bootstrap
	// server); 1 in-process.
	Processes int `json:"processes"`

	Requests int `json:"requests"`
	// OK requests were verified byte for byte on every decode rank;
	// Failed ones were not (see Failures).
	OK     int `json:"ok"`
	Failed int `json:"failed"`
	// VerifyErrors counts requests whose bytes a decode rank found wrong.
	VerifyErrors int `json:"verify_errors"`

	BytesMoved    uint64  `json:"bytes_moved"`    // by the transfers
	BytesVerified uint64  `json:"bytes_verified"` // checked on decode (prefix hits included)
	Seconds       float64 `json:"seconds"`        // the workers' transfer phase
	// GBps is BytesMoved / Seconds: the end-to-end rate, which includes
	// filling and checking the synthetic KV.
	GBps float64 `json:"gb_per_s"`
	// TransferSeconds is the time transfers were in flight (the union of
	// their post-to-completion intervals: sglang, the prefill's, every
	// rank's; vllm, every decode rank's, whichever process made them) and
	// TransferGBps BytesMoved over it: the rate at which kvhost moved
	// bytes, to compare with MemcpyGBps.
	TransferSeconds float64 `json:"transfer_seconds"`
	TransferGBps    float64 `json:"transfer_gb_per_s"`

	Transfers uint64 `json:"transfers"`
	// Transfer latency (post to completion) in µs. sglang: over every
	// transfer the prefill posted. vllm: the largest of the decode
	// processes' own percentiles (each process pulls its share).
	XferP50us        float64 `json:"xfer_p50_us"`
	XferP99us        float64 `json:"xfer_p99_us"`
	DescsPerRequest  float64 `json:"descriptors_per_request"`
	BytesPerTransfer float64 `json:"bytes_per_transfer"`

	// MemcpyGBps is this machine's raw memcpy rate, measured in the same
	// run with blocks of BytesPerTransfer.
	MemcpyGBps float64 `json:"memcpy_gb_per_s"`

	// CPURunSeconds and CPUWaitSeconds are what the demo's threads did over
	// the requests phase (the kernel's schedstat, summed over threads):
	// seconds on a CPU, and seconds runnable but waiting for one, which
	// on a machine with fewer cores than busy threads bounds the rates
	// above; CPUWaitPerRun is their ratio. CPUScope says whose threads and
	// which window, or why they are null (not measured).
	CPURunSeconds  *float64 `json:"cpu_run_seconds"`
	CPUWaitSeconds *float64 `json:"cpu_wait_seconds"`
	CPUWaitPerRun  *float64 `json:"cpu_wait_per_run"`
	CPUScope       string   `json:"cpu_scope"`

	Failures []string `json:"failures,omitempty"` // the first few, with reasons
	// Workers are the workers' own JSON summaries.
	Workers []json.RawMessage `json:"workers"`
}

// Success reports whether every request was verified on every decode rank.
func (s *Summary) Success() bool {
	return s.Requests > 0 && s.OK == s.Requests && s.Failed == 0 && s.VerifyErrors == 0
}

const maxFailures = 10

func (s *Summary) addFailure(f string) {
	if len(s.Failures) < maxFailures {
		s.Failures = append(s.Failures, f)
	}
}

// requestTally counts, per request, the decode ranks that verified it.
type requestTally struct {
	ok     map[string]int
	failed map[string]string // request -> first reason
}

func newTally() *requestTally {
	return &requestTally{ok: map[string]int{}, failed: map[string]string{}}
}

// addReport reads one decode rank's per-request lines (sglang:
// {"room","ok","reason"}, vllm: {"request_id","ok","error"}).
func (t *requestTally) addReport(r io.Reader) error {
	dec := json.NewDecoder(r)
	for {
		var line struct {
			Room      *uint64 `json:"room"`
			RequestID string  `json:"request_id"`
			OK        bool    `json:"ok"`
			Reason    string  `json:"reason"`
			Error     string  `json:"error"`
		}
		if err := dec.Decode(&line); err == io.EOF {
			return nil
		} else if err != nil {
			return fmt.Errorf("request report: %w", err)
		}
		id := line.RequestID
		if line.Room != nil {
			id = fmt.Sprintf("room %d", *line.Room)
		}
		if line.OK {
			t.ok[id]++
		} else if _, seen := t.failed[id]; !seen {
			t.failed[id] = line.Reason + line.Error
		}
	}
}

// apply sets OK, Failed and Failures: a request is OK when all ranks
// reported it verified.
func (t *requestTally) apply(s *Summary, ranks int) {
	s.OK, s.Failed = 0, 0
	var failed []string
	for id, n := range t.ok {
		if _, bad := t.failed[id]; !bad && n == ranks {
			s.OK++
		}
	}
	for id, why := range t.failed {
		failed = append(failed, id+": "+why)
	}
	sort.Strings(failed)
	s.Failed = s.Requests - s.OK
	for _, f := range failed {
		s.addFailure(f)
	}
	if s.Failed > 0 && len(failed) == 0 {
		s.addFailure(fmt.Sprintf("%d requests were not reported verified by every decode rank", s.Failed))
	}
}

// addPush folds in the push workers' summaries.
func (s *Summary) addPush(prefill *pushworker.Summary, decodes []*pushworker.Summary) {
	if prefill != nil {
		s.BytesMoved = prefill.Bytes
		s.Transfers = prefill.Transfers
		s.Seconds = prefill.DurationSec
		s.TransferSeconds = prefill.TransferSec
		s.XferP50us, s.XferP99us = prefill.XferP50us, prefill.XferP99us
		s.DescsPerRequest = float64(prefill.Descriptors) / float64(s.Requests)
		s.VerifyErrors += prefill.VerifyErrors
		for _, f := range prefill.Failures {
			s.addFailure(fmt.Sprintf("prefill %s room %d: %s", f.Rank, f.Room, f.Reason))
		}
		if prefill.Leaked > 0 {
			s.addFailure(fmt.Sprintf("prefill leaked %d rooms", prefill.Leaked))
		}
	}
	for _, d := range decodes {
		s.BytesVerified += d.Bytes
		s.VerifyErrors += d.VerifyErrors
		for _, f := range d.Failures {
			s.addFailure(fmt.Sprintf("decode %s room %d: %s", f.Rank, f.Room, f.Reason))
		}
		if d.Leaked > 0 {
			s.addFailure(fmt.Sprintf("decode %v leaked %d rooms", d.Ranks, d.Leaked))
		}
	}
}

// addPull folds in the pull workers' summaries.
func (s *Summary) addPull(prefill *pullworker.PrefillSummary, decodes []*pullworker.DecodeSummary) {
	var descs float64
	// The time any decode rank's READ was in flight: the union over the
	// ranks, which run at once (a sidecar hosting every rank counts it so:
	// kvhost_transfer_busy_seconds_total); the longest rank's own when a
	// rank did not report its intervals.
	var all span.Union
	whole := true
	for _, d := range decodes {
		whole = whole && (len(d.InFlight) > 0 || d.TransferSeconds == 0)
		for _, iv := range d.InFlight {
			all.AddNs(iv[0], iv[1])
		}
	}
	for _, d := range decodes {
		s.BytesMoved += d.Bytes
		s.BytesVerified += d.VerifiedBytes
		s.Transfers += uint64(d.Reads)
		descs += d.DescriptorsPerRead * float64(d.Reads)
		s.Seconds = max(s.Seconds, d.Seconds)
		s.TransferSeconds = max(s.TransferSeconds, d.TransferSeconds)
		s.XferP50us = max(s.XferP50us, d.TransferMs.P50*1e3)
		s.XferP99us = max(s.XferP99us, d.TransferMs.P99*1e3)
		for _, f := range d.FailedRequests {
			s.addFailure(fmt.Sprintf("decode rank %v %s: %s", d.Ranks, f.ID, f.Error))
		}
	}
	s.DescsPerRequest = descs / float64(s.Requests)
	if whole {
		s.TransferSeconds = all.Total().Seconds()
	}
	if prefill != nil && !prefill.Done {
		s.addFailure(fmt.Sprintf("prefill: %d of %d requests released, %d still held, %d expired",
			prefill.ReleasedNotified, prefill.ExpectedRequests, prefill.StillHeld, prefill.ReleasedExpired))
	}
}

// setCPU reports u, what the threads of scope did; nil u: not measured,
// scope says why.
func (s *Summary) setCPU(u *schedstat.Usage, scope string) {
	s.CPUScope = scope
	s.CPURunSeconds, s.CPUWaitSeconds, s.CPUWaitPerRun = nil, nil, nil
	if u != nil {
		run, wait, ratio := u.RunSeconds, u.WaitSeconds, u.WaitPerRun()
		s.CPURunSeconds, s.CPUWaitSeconds, s.CPUWaitPerRun = &run, &wait, &ratio
	}
}

// sumWorkerCPU reports the sum of the worker processes' own measures
// (each over its own requests phase); nil where a worker reported none,
// and then the sum is not reported: a part would read as a whole.
func (s *Summary) sumWorkerCPU(workers []*schedstat.Usage, others string) {
	var sum schedstat.Usage
	got := 0
	for _, u := range workers {
		if u != nil {
			sum = sum.Add(*u)
			got++
		}
	}
	if got < len(workers) || got == 0 {
		why := fmt.Sprintf("%d of %d worker processes reported theirs", got, len(workers))
		if _, err := schedstat.Self(); err != nil {
			why = err.Error()
		}
		s.setCPU(nil, "not measured: "+why)
		return
	}
	s.setCPU(&sum, fmt.Sprintf("the %d worker processes' threads, each over its own requests phase%s", got, others))
}

func (s *Summary) finish() {
	if s.Seconds > 0 {
		s.GBps = float64(s.BytesMoved) / s.Seconds / 1e9
	}
	if s.TransferSeconds > 0 {
		s.TransferGBps = float64(s.BytesMoved) / s.TransferSeconds / 1e9
	}
	if s.Transfers > 0 {
		s.BytesPerTransfer = float64(s.BytesMoved) / float64(s.Transfers)
	}
}

// WriteText prints the summary for a person.
func (s *Summary) WriteText(w io.Writer) error {
	verdict := "OK: every byte verified"
	if !s.Success() {
		verdict = "FAILED"
	}
	where := fmt.Sprintf("%d processes", s.Processes)
	if s.Processes == 1 {
		where = "one process"
	}
	var b strings.Builder
	fmt.Fprintf(&b, "kvhost demo (%s style, %s, prefill TP %d -> decode TP %d, %s plugin, %s pools, %s): %s\n",
		s.Style, strings.ToUpper(s.Attention), s.PrefillTP, s.DecodeTP, s.Plugin, strings.ToUpper(s.MemKinds), where, verdict)
	fmt.Fprintf(&b, "  requests      %d ok, %d failed (of %d)\n", s.OK, s.Failed, s.Requests)
	fmt.Fprintf(&b, "  bytes         %s moved, %s verified on decode\n", human(float64(s.BytesMoved)), human(float64(s.BytesVerified)))
	fmt.Fprintf(&b, "  transfer rate %.2f GB/s over %.3f s with transfers in flight   (raw memcpy on this machine: %.2f GB/s)\n",
		s.TransferGBps, s.TransferSeconds, s.MemcpyGBps)
	fmt.Fprintf(&b, "  end to end    %.2f GB/s over %.2f s   (includes filling and checking the synthetic KV)\n", s.GBps, s.Seconds)
	fmt.Fprintf(&b, "  transfers     %d, %s each on average; latency p50 %s, p99 %s\n",
		s.Transfers, human(s.BytesPerTransfer), micros(s.XferP50us), micros(s.XferP99us))
	fmt.Fprintf(&b, "  descriptors   %.1f per request\n", s.DescsPerRequest)
	if s.CPURunSeconds != nil && s.CPUWaitSeconds != nil && s.CPUWaitPerRun != nil {
		fmt.Fprintf(&b, "  CPU           kvhost's threads ran %.2f s and waited %.2f s for a core (wait/run %.2f): %s\n",
			*s.CPURunSeconds, *s.CPUWaitSeconds, *s.CPUWaitPerRun, s.CPUScope)
	} else {
		fmt.Fprintf(&b, "  CPU           %s\n", s.CPUScope)
	}
	if s.VerifyErrors > 0 {
		fmt.Fprintf(&b, "  verify errors %d requests with wrong bytes\n", s.VerifyErrors)
	}
	for _, f := range s.Failures {
		fmt.Fprintf(&b, "  failure: %s\n", f)
	}
	_, err := io.WriteString(w, b.String())
	return err
}

func human(n float64) string {
	units := []string{"B", "KiB", "MiB", "GiB", "TiB"}
	i := 0
	for n >= 1024 && i < len(units)-1 {
		n /= 1024
		i++
	}
	if i == 0 {
		return fmt.Sprintf("%.0f B", n)
	}
	return fmt.Sprintf("%.1f %s", n, units[i])
}

func micros(us float64) string {
	if us >= 1000 {
		return fmt.Sprintf("%.2f ms", us/1000)
	}
	return fmt.Sprintf("%.0f µs", us)
}
