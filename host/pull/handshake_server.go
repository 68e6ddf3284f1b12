package pull

import (
	"context"
	"errors"
	"log/slog"
	"maps"
	"sync"
	"time"

	"github.com/kvhost/kvhost/host/internal/ratelog"
	"github.com/kvhost/kvhost/host/internal/zmq"
	"github.com/kvhost/kvhost/host/wire/vllm"
)

// replyTimeout bounds one reply write; a client that stops reading loses
// its connection after it. Replies are queued per client (zmq's
// Router.Enqueue), so a client that stops reading delays nobody else.
const replyTimeout = time.Second

// replyQueue bounds the replies waiting for one client: a REQ client has
// one request, so one reply, at a time; a client that pipelines requests
// without reading the replies has the excess ones refused.
const replyQueue = 2

// maxRequestMessage bounds a received handshake request (all frames): a real
// one is the empty delimiter and about 20 bytes of msgpack, so anything
// bigger is refused while it is read, before it is buffered. Callers'
// zmq.Options come after this default and may raise it.
const maxRequestMessage = 4 << 10

// HandshakeServer is the prefill side of the handshake: a ZeroMQ ROUTER
// that answers every [get_meta_msg, tp_rank] request with the encoded
// handshake payload of that TP rank (vLLM's _nixl_handshake_listener).
// It serves any number of clients; a request it cannot answer (garbage,
// wrong tag, unknown rank, no frame or more than one after the REQ
// delimiter) is logged (rate-limited) and refused with an empty reply, so
// a REQ client fails at once instead of waiting for its timeout, and the
// server keeps serving.
// Replies never block the server: a client that does not read them only
// loses its own (and its connection after replyTimeout).
type HandshakeServer struct {
	router *zmq.Router
	svc    HandshakeService
	log    *slog.Logger    // rate-limited: a client can trigger its lines
	rlog   *ratelog.Logger // log's limiter, flushed by Close
	done   chan struct{}
	wg     sync.WaitGroup
}

// HandshakeService is what a side channel serves: the encoded
// NixlHandshakePayload per TP rank, in the shape of the engine's
// generation, and the clock a version-6 reply carries.
type HandshakeService struct {
	// Gen is the engine's generation (nil: version 2): the request shape
	// it answers and the reply frames it sends.
	Gen *vllm.Generation
	// Payloads are the encoded payloads by TP rank (of PP rank 0, the
	// only one kvhost serves). Never modified once served.
	Payloads map[int][]byte
	// Clock returns the prefill's perf_counter() for a version-6 reply:
	// seconds from any fixed origin (the decode keeps only an offset).
	// nil: 0.
	Clock func() float64
}

// Reply answers req, a handshake request's frames after the REQ
// delimiter: the reply frames of the TP rank it asks for, or one empty
// frame with refusal (the log line) and why (its detail) set. A REQ client
// waits for a reply whatever it sent: the empty one makes it fail at once,
// not at its timeout.
func (h *HandshakeService) Reply(req [][]byte) (reply [][]byte, rank int, refusal string, why slog.Attr) {
	refuse := [][]byte{{}}
	if len(req) != 1 {
		return refuse, 0, "refusing handshake request: want one frame after the delimiter", slog.Int("frames", len(req))
	}
	g := vllm.Or(h.Gen)
	pp, rank, err := g.DecodeMetaRequest(req[0])
	if err != nil {
		return refuse, 0, "refusing handshake request", slog.Any("err", err)
	}
	if pp != 0 {
		return refuse, 0, "refusing handshake request for a pipeline-parallel rank other than 0 (kvhost serves PP rank 0 only)", slog.Int("pp_rank", pp)
	}
	if h.Payloads[rank] == nil {
		return refuse, 0, "refusing handshake request for an unknown TP rank", slog.Int("tp_rank", rank)
	}
	clock := 0.0
	if h.Clock != nil {
		clock = h.Clock()
	}
	return g.ReplyFrames(h.Payloads[rank], clock), rank, "", slog.Attr{}
}

// ListenHandshake binds a ROUTER socket on endpoint (vLLM binds
// tcp://VLLM_NIXL_SIDE_CHANNEL_HOST:side_channel_port) and serves svc
// until Close. svc.Payloads is copied. A peer whose request is larger than
// a handshake request can be (4 KiB) is disconnected; opts may raise that
// limit (zmq.WithMaxMessageSize).
func ListenHandshake(endpoint string, svc HandshakeService, log *slog.Logger, opts ...zmq.Option) (*HandshakeServer, error) {
	if log == nil {
		log = slog.Default()
	}
	defaults := []zmq.Option{zmq.WithLogger(log), zmq.WithMaxMessageSize(maxRequestMessage), zmq.WithMaxFrames(4),
		zmq.WithSendTimeout(replyTimeout), zmq.WithSendQueue(replyQueue)}
	r, err := zmq.ListenRouter(endpoint, append(defaults, opts...)...)
	if err != nil {
		return nil, err
	}
	rlog := ratelog.New(log)
	s := &HandshakeServer{
		router: r,
		svc:    HandshakeService{Gen: svc.Gen, Payloads: maps.Clone(svc.Payloads), Clock: svc.Clock},
		log:    rlog.With("component", "vllm_handshake_server", "endpoint", r.Endpoint()),
		rlog:   rlog,
		done:   make(chan struct{}),
	}
	s.wg.Add(1)
	go s.serve()
	return s, nil
}

func (s *HandshakeServer) serve() {
	defer s.wg.Done()
	ctx, cancel := context.WithCancel(context.Background())
	go func() {
		<-s.done
		cancel()
	}()
	for {
		m, err := s.router.Recv(ctx)
		if err != nil {
			if !errors.Is(err, zmq.ErrClosed) && ctx.Err() == nil {
				s.log.Error("handshake listener stopped", "err", err)
			}
			return
		}
		s.handle(m)
	}
}

func (s *HandshakeServer) handle(m zmq.RouterMsg) {
	// A REQ peer's message is [empty delimiter, request].
	if len(m.Frames) == 0 || len(m.Frames[0]) != 0 {
		s.log.Warn("refusing handshake request: not a REQ message (no empty delimiter)", "peer", m.Peer, "frames", len(m.Frames))
		return // not a REQ peer: there is no reply shape it expects
	}
	reply, rank, refusal, why := s.svc.Reply(m.Frames[1:])
	if refusal != "" {
		s.log.Warn(refusal, "peer", m.Peer, why)
	} else {
		s.log.Debug("serving handshake", "peer", m.Peer, "tp_rank", rank)
	}
	switch err := s.router.Enqueue(m.Peer, append([][]byte{nil}, reply...)...); {
	case errors.Is(err, zmq.ErrPeerBusy):
		s.log.Warn("dropping handshake request: the client is not reading its replies", "peer", m.Peer)
	case err != nil:
		s.log.Debug("handshake reply not delivered", "peer", m.Peer, "err", err)
	}
}

// Endpoint is where clients connect.
func (s *HandshakeServer) Endpoint() string { return s.router.Endpoint() }

// Port is the side-channel port the server listens on.
func (s *HandshakeServer) Port() int { return s.router.Port() }

// Close stops serving and releases the socket; calling it again is a
// no-op.
func (s *HandshakeServer) Close() error {
	select {
	case <-s.done:
		return nil
	default:
	}
	close(s.done)
	err := s.router.Close()
	s.wg.Wait()
	s.rlog.Close()
	return err
}
