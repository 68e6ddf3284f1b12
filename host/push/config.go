package push

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/kvhost/kvhost/abi"
)

// Variant selects the control message layout spoken with the peer.
type Variant uint8

const (
	// VariantNIXL is SGLang's NIXL connector layout (guard NixlMsgGuard,
	// agent metadata and pointer lists).
	VariantNIXL Variant = iota
	// VariantMORI is SGLang's MORI-IO connector layout (guard
	// MoriMsgGuard, packed engine and memory descriptors, status messages).
	VariantMORI
)

func (v Variant) String() string {
	switch v {
	case VariantNIXL:
		return "nixl"
	case VariantMORI:
		return "mori"
	}
	return fmt.Sprintf("Variant(%d)", int(v))
}

// ParseVariant parses "nixl" or "mori".
func ParseVariant(s string) (Variant, error) {
	switch strings.ToLower(s) {
	case "nixl":
		return VariantNIXL, nil
	case "mori":
		return VariantMORI, nil
	}
	return 0, fmt.Errorf("unknown wire variant %q (want nixl or mori)", s)
}

// Completion selects how prefill tells decode that a room's bytes landed.
type Completion uint8

const (
	// CompletionAuto uses transfer notifications on the NIXL variant when
	// the plugin agent supports them, and status messages otherwise (the
	// MORI variant always uses status messages, as SGLang does).
	CompletionAuto Completion = iota
	// CompletionNotif attaches notifications to transfers (needs CapNotif).
	CompletionNotif
	// CompletionStatus sends status messages over ZeroMQ.
	CompletionStatus
)

func (c Completion) String() string {
	switch c {
	case CompletionAuto:
		return "auto"
	case CompletionNotif:
		return "notif"
	case CompletionStatus:
		return "status"
	}
	return fmt.Sprintf("Completion(%d)", int(c))
}

// ParseCompletion parses "auto", "notif" or "status".
func ParseCompletion(s string) (Completion, error) {
	switch strings.ToLower(s) {
	case "auto", "":
		return CompletionAuto, nil
	case "notif", "notification", "notifications":
		return CompletionNotif, nil
	case "status":
		return CompletionStatus, nil
	}
	return 0, fmt.Errorf("unknown completion mode %q (want auto, notif or status)", s)
}

// XferMode selects how a chunk's KV copies reach the plugin.
type XferMode uint8

const (
	// XferAuto (the zero value) chooses by the agent's native capabilities
	// (plugin.Agent.Caps): with native strides, XferBatch, whose strided
	// copies the plugin takes as they are (the fewest descriptors and the
	// cheapest plan on head-slice shapes); without strides but with native
	// prepped lists (NIXL variant), XferPrepped: the runtime plans indices
	// into the lists and never expands strided copies the plugin would
	// not take; otherwise XferBatch, expanded by the host into plain
	// descriptors. Prefill.XferMode says what was chosen.
	XferAuto XferMode = iota
	// XferBatch posts the planner's strided copies as one batch transfer
	// over (local region, remote region) pairs imported once per peer: the
	// fewest descriptors.
	XferBatch
	// XferPrepped builds SGLang's disaggregation/nixl/conn.py's
	// prepared descriptor lists once per
	// peer and posts index arrays per chunk (SGLang NIXL's make_prepped_xfer;
	// NIXL variant only).
	XferPrepped
)

// resolveXfer turns XferAuto into the mode the agent's native capabilities
// favour (see XferAuto) and refuses prepped transfers on the MORI variant.
func resolveXfer(v Variant, x XferMode, caps abi.Caps) (XferMode, error) {
	switch x {
	case XferAuto:
		if v == VariantNIXL && caps.Has(abi.CapPrepped) && !caps.Has(abi.CapStrided) {
			return XferPrepped, nil
		}
		return XferBatch, nil
	case XferPrepped:
		if v == VariantMORI {
			return 0, errors.New("push: prepped transfers are SGLang NIXL's; the MORI variant posts batch writes")
		}
	}
	return x, nil
}

func (m XferMode) String() string {
	switch m {
	case XferAuto:
		return "auto"
	case XferBatch:
		return "batch"
	case XferPrepped:
		return "prepped"
	}
	return fmt.Sprintf("XferMode(%d)", int(m))
}

// ParseXferMode parses "auto" (or ""), "batch" or "prepped".
func ParseXferMode(s string) (XferMode, error) {
	switch strings.ToLower(s) {
	case "auto", "":
		return XferAuto, nil
	case "batch":
		return XferBatch, nil
	case "prepped":
		return XferPrepped, nil
	}
	return 0, fmt.Errorf("unknown transfer mode %q (want auto, batch or prepped)", s)
}

// Reference defaults (SGLang envs).
const (
	DefaultBootstrapTimeout     = 300 * time.Second
	DefaultWaitingTimeout       = 300 * time.Second
	DefaultHeartbeatInterval    = 5 * time.Second
	DefaultHeartbeatMaxFailures = 2
	DefaultQueueSize            = 4
	// Defaults of Settings.MaxPendingInfoBytes and
	// MaxPendingInfoBytesPerPeer.
	DefaultMaxPendingInfoBytes        = 64 << 20
	DefaultMaxPendingInfoBytesPerPeer = 16 << 20
	// MinReferenceHeartbeat is the floor SGLang puts under the heartbeat
	// interval. kvhost honours shorter intervals (tests use them) but the
	// env/flag loaders warn.
	MinReferenceHeartbeat = 2 * time.Second
)

// Environment variables read by LoadEnv, each with its SGLang alias where
// SGLang has one. The kvhost name wins when both are set.
var (
	EnvBootstrapTimeout  = [2]string{"KVHOST_BOOTSTRAP_TIMEOUT", "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT"}
	EnvWaitingTimeout    = [2]string{"KVHOST_WAITING_TIMEOUT", "SGLANG_DISAGGREGATION_WAITING_TIMEOUT"}
	EnvHeartbeatInterval = [2]string{"KVHOST_HEARTBEAT_INTERVAL", "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL"}
	EnvHeartbeatFailures = [2]string{"KVHOST_HEARTBEAT_MAX_FAILURE", "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE"}
	EnvQueueSize         = [2]string{"KVHOST_QUEUE_SIZE", "SGLANG_DISAGGREGATION_QUEUE_SIZE"}
	// The transfer SLA: SGLang's MORI variable is in milliseconds.
	EnvTransferTimeout = [2]string{"KVHOST_TRANSFER_TIMEOUT", "SGLANG_MORI_TRANSFER_TIMEOUT_MS"}
	EnvMORIAuxRDMA     = [2]string{"KVHOST_MORI_SEND_AUX_RDMA", "SGLANG_MORI_SEND_AUX_RDMA"}
)

// Settings are the runtime's tunables. The zero value means "reference
// default" for every field.
type Settings struct {
	// BootstrapTimeout fails a prefill room still Bootstrapping (decode
	// never sent its metadata) after this long. Default 300 s.
	BootstrapTimeout time.Duration
	// WaitingTimeout fails a decode room whose transfer did not complete
	// this long after the metadata went out (and tells prefill with
	// ABORT). Default 300 s.
	WaitingTimeout time.Duration
	// TransferTimeout is an optional SLA on one chunk's transfers (from
	// post to completion); 0 disables it.
	TransferTimeout time.Duration
	// HeartbeatInterval is how often decode checks each bootstrap server's
	// /health. Default 5 s.
	HeartbeatInterval time.Duration
	// HeartbeatMaxFailures consecutive failed checks fail every unfinished
	// room of that prefill. Default 2.
	HeartbeatMaxFailures int
	// QueueSize is the number of transfer worker shards (prefill). Default 4.
	QueueSize int
	// MORIAuxRDMA sends MORI aux by RDMA write instead of AUX_DATA messages
	// over ZeroMQ (SGLANG_MORI_SEND_AUX_RDMA, default false).
	MORIAuxRDMA bool
	// MaxPeers bounds the decode ranks one prefill rank accepts
	// registrations from (a hostile peer must not grow memory without
	// bound). Default 4096.
	MaxPeers int
	// MaxPendingInfoBytes bounds the memory that decode ranks' transfer
	// infos (page lists, state indices) may hold on a prefill rank while
	// their room is not yet both complete (every decode rank reported) and
	// opened by the engine (NewSender), in total; MaxPendingInfoBytesPerPeer
	// bounds it per registered decode agent (infos naming agents that are
	// not registered share one such budget). An info that does not fit is
	// dropped, and its room fails with the reason: at once if the engine
	// holds it, else as soon as the engine opens it (within the bootstrap
	// timeout). Defaults 64 MiB and 16 MiB (16 MiB is 4M page indices).
	MaxPendingInfoBytes        int64
	MaxPendingInfoBytesPerPeer int64
}

// withDefaults fills zero fields with SGLang's disaggregation/{nixl,mori}/conn.py defaults.
func (s Settings) withDefaults() Settings {
	if s.BootstrapTimeout <= 0 {
		s.BootstrapTimeout = DefaultBootstrapTimeout
	}
	if s.WaitingTimeout <= 0 {
		s.WaitingTimeout = DefaultWaitingTimeout
	}
	if s.HeartbeatInterval <= 0 {
		s.HeartbeatInterval = DefaultHeartbeatInterval
	}
	if s.HeartbeatMaxFailures <= 0 {
		s.HeartbeatMaxFailures = DefaultHeartbeatMaxFailures
	}
	if s.QueueSize <= 0 {
		s.QueueSize = DefaultQueueSize
	}
	if s.MaxPeers <= 0 {
		s.MaxPeers = 4096
	}
	if s.MaxPendingInfoBytes <= 0 {
		s.MaxPendingInfoBytes = DefaultMaxPendingInfoBytes
	}
	if s.MaxPendingInfoBytesPerPeer <= 0 {
		s.MaxPendingInfoBytesPerPeer = DefaultMaxPendingInfoBytesPerPeer
	}
	if s.TransferTimeout < 0 {
		s.TransferTimeout = 0
	}
	return s
}

// LoadEnv overrides s with the environment variables above (lookup is
// os.LookupEnv when nil). Durations accept SGLang's plain numbers (seconds;
// milliseconds for SGLANG_MORI_TRANSFER_TIMEOUT_MS) or Go durations ("90s").
func (s *Settings) LoadEnv(lookup func(string) (string, bool), log *slog.Logger) error {
	if lookup == nil {
		lookup = os.LookupEnv
	}
	get := func(names [2]string) (string, string, bool) {
		for _, n := range names {
			if v, ok := lookup(n); ok && strings.TrimSpace(v) != "" {
				return n, strings.TrimSpace(v), true
			}
		}
		return "", "", false
	}
	var errs []error
	dur := func(names [2]string, dst *time.Duration, unit time.Duration) {
		if n, v, ok := get(names); ok {
			d, err := ParseSeconds(v, unit)
			if err != nil {
				errs = append(errs, fmt.Errorf("%s: %w", n, err))
				return
			}
			*dst = d
		}
	}
	integer := func(names [2]string, dst *int) {
		if n, v, ok := get(names); ok {
			i, err := strconv.Atoi(v)
			if err != nil || i < 0 {
				errs = append(errs, fmt.Errorf("%s: %q is not a non-negative integer", n, v))
				return
			}
			*dst = i
		}
	}
	dur(EnvBootstrapTimeout, &s.BootstrapTimeout, time.Second)
	dur(EnvWaitingTimeout, &s.WaitingTimeout, time.Second)
	dur(EnvHeartbeatInterval, &s.HeartbeatInterval, time.Second)
	integer(EnvHeartbeatFailures, &s.HeartbeatMaxFailures)
	integer(EnvQueueSize, &s.QueueSize)
	if n, v, ok := get(EnvTransferTimeout); ok {
		unit := time.Second
		if n == EnvTransferTimeout[1] {
			unit = time.Millisecond
		}
		d, err := ParseSeconds(v, unit)
		if err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", n, err))
		} else {
			s.TransferTimeout = d
		}
	}
	if n, v, ok := get(EnvMORIAuxRDMA); ok {
		b, err := parseBool(v)
		if err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", n, err))
		} else {
			s.MORIAuxRDMA = b
		}
	}
	if s.HeartbeatInterval > 0 && s.HeartbeatInterval < MinReferenceHeartbeat && log != nil {
		log.Warn("heartbeat interval below SGLang's 2 s floor", "interval", s.HeartbeatInterval)
	}
	return errors.Join(errs...)
}

// ParseSeconds parses a duration the way SGLang's env vars give them: a
// plain number counts in unit ("300" seconds, "2.5"), anything else is a
// Go duration ("90s", "500ms").
func ParseSeconds(v string, unit time.Duration) (time.Duration, error) {
	v = strings.TrimSpace(v)
	if f, err := strconv.ParseFloat(v, 64); err == nil {
		if f < 0 || f > float64(1<<62)/float64(unit) {
			return 0, fmt.Errorf("duration %q out of range", v)
		}
		return time.Duration(f * float64(unit)), nil
	}
	d, err := time.ParseDuration(v)
	if err != nil {
		return 0, fmt.Errorf("%q is neither a number nor a duration", v)
	}
	if d < 0 {
		return 0, fmt.Errorf("duration %q is negative", v)
	}
	return d, nil
}

func parseBool(v string) (bool, error) {
	switch strings.ToLower(v) {
	case "1", "true", "yes", "on":
		return true, nil
	case "0", "false", "no", "off", "":
		return false, nil
	}
	return false, fmt.Errorf("%q is not a boolean", v)
}

// Seconds is a flag value (flag.Value and urfave/cli Generic) holding a
// duration written as SGLang writes it (plain seconds) or as a Go duration.
type Seconds struct {
	D    time.Duration
	Unit time.Duration // unit of plain numbers; 0 means seconds
}

// Set parses v.
func (s *Seconds) Set(v string) error {
	u := s.Unit
	if u == 0 {
		u = time.Second
	}
	d, err := ParseSeconds(v, u)
	if err != nil {
		return err
	}
	s.D = d
	return nil
}

// String formats the duration.
func (s *Seconds) String() string {
	if s == nil {
		return ""
	}
	return s.D.String()
}
