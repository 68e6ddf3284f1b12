package push

import (
	"time"

	"github.com/kvhost/kvhost/host/plugin"
	"github.com/kvhost/kvhost/host/push/rooms"
)

// Role is which side of a transfer a manager plays.
type Role uint8

const (
	RolePrefill Role = iota
	RoleDecode
)

func (r Role) String() string {
	if r == RoleDecode {
		return "decode"
	}
	return "prefill"
}

// Side is the role's side of the KV transfers: the prefill writes (it
// initiates), the decode is written to.
func (r Role) Side() plugin.Side {
	if r == RoleDecode {
		return plugin.Target
	}
	return plugin.Initiator
}

// TransferKind says what a transfer carried.
type TransferKind uint8

const (
	TransferKV TransferKind = iota
	TransferAux
	TransferState
)

func (k TransferKind) String() string {
	switch k {
	case TransferAux:
		return "aux"
	case TransferState:
		return "state"
	}
	return "kv"
}

// TransferEvent describes one plugin transfer a prefill rank posted and
// finished (successfully or not): the agent's completion engine's event
// (plugin.TransferEvent: bytes, descriptors, post and transfer times from
// the plugin's telemetry when it has it, else from the host's clock; the
// planning time; the error) and which room, decode rank and chunk it
// served. pull reports its READs with the same plugin.TransferEvent, so
// metrics has one adapter for both.
type TransferEvent struct {
	Room  uint64
	Peer  string // the decode rank's agent (engine) name
	Kind  TransferKind
	Chunk int
	// ReferenceDescs is how many descriptors SGLang's connector would have
	// handed its backend for the same bytes (0 when unknown).
	ReferenceDescs uint64
	plugin.TransferEvent
}

// FailureEvent is a room that failed.
type FailureEvent struct {
	Role   Role
	Room   uint64
	Reason string
	// Remote is true when the peer reported the failure (status message,
	// ABORT) rather than this worker detecting it.
	Remote bool
}

// HandshakeKind names the control-plane steps whose latency is reported.
type HandshakeKind uint8

const (
	// HandshakeRegisterBootstrap: a prefill rank's PUT /route.
	HandshakeRegisterBootstrap HandshakeKind = iota
	// HandshakeParallelInfo: decode's query of a prefill deployment's
	// layout (GET /route with all -1), including waiting for it to be
	// ready.
	HandshakeParallelInfo
	// HandshakeRoute: decode's lookup of one prefill rank.
	HandshakeRoute
	// HandshakePeer: prefill's processing of a decode rank's registration
	// (metadata load, remote region imports, planners, prepared lists).
	HandshakePeer
	// HandshakeHeartbeat: one decode heartbeat (GET /health).
	HandshakeHeartbeat
)

func (k HandshakeKind) String() string {
	switch k {
	case HandshakeRegisterBootstrap:
		return "register_bootstrap"
	case HandshakeParallelInfo:
		return "parallel_info"
	case HandshakeRoute:
		return "route"
	case HandshakePeer:
		return "peer_registration"
	case HandshakeHeartbeat:
		return "heartbeat"
	}
	return "unknown"
}

// HandshakeEvent is one control-plane step and how long it took.
type HandshakeEvent struct {
	Role    Role
	Kind    HandshakeKind
	Peer    string // bootstrap address, prefill rank endpoint or decode agent
	Latency time.Duration
	Err     error
}

// RoomEvent is a room's status change (or creation, Change.New).
type RoomEvent struct {
	Role Role
	rooms.Change
}

// Observer receives the runtime's events, so metrics (Prometheus, the demo
// summary) can be added without touching the runtime. Methods are called
// synchronously from runtime goroutines, concurrently: implementations
// must be safe for concurrent use and quick (no blocking I/O).
type Observer interface {
	Transfer(TransferEvent)
	Failure(FailureEvent)
	Room(RoomEvent)
	Handshake(HandshakeEvent)
}

// NopObserver ignores every event; embed it to implement only some methods.
type NopObserver struct{}

func (NopObserver) Transfer(TransferEvent)   {}
func (NopObserver) Failure(FailureEvent)     {}
func (NopObserver) Room(RoomEvent)           {}
func (NopObserver) Handshake(HandshakeEvent) {}

// Observers fans events out to several observers.
type Observers []Observer

func (o Observers) Transfer(e TransferEvent) {
	for _, x := range o {
		x.Transfer(e)
	}
}

func (o Observers) Failure(e FailureEvent) {
	for _, x := range o {
		x.Failure(e)
	}
}

func (o Observers) Room(e RoomEvent) {
	for _, x := range o {
		x.Room(e)
	}
}

func (o Observers) Handshake(e HandshakeEvent) {
	for _, x := range o {
		x.Handshake(e)
	}
}
