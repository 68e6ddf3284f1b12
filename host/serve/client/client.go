// Package client is a Go client of the engine control API of `kvhost
// serve` (docs/engine-api.md): one DEALER connection per engine process,
// typed methods for every op, and the connection's events on a channel.
// Tests, the test engine (host/serve/internal/testengine) and the
// benchmarks use it; Python engines use python/kvhost/client.py.
//
// Every method sends one request and waits for its reply (ctx bounds the
// wait). Requests may be issued from several goroutines; the sidecar
// answers each connection's requests in order. An error reply is an
// *Error with the API's code; when the connection drops, every request in
// flight fails with code CodeDisconnected and Done is closed.
package client

import (
	"context"
	"errors"
	"fmt"
	"os"
	"sync"
	"sync/atomic"

	"github.com/kvhost/kvhost/host/internal/msgpack"
)

// Protocol version this client speaks.
const (
	Major = 1
	Minor = 0
)

// CodeDisconnected is the code of the *Error a request gets when the
// connection drops before its reply (a client-side code, never sent by
// the sidecar).
const CodeDisconnected = "disconnected"

// ReasonConnectionLost is the reason of the room events the client makes
// up for rooms it tracked when the connection drops (docs/engine-api.md,
// Lifecycle).
const ReasonConnectionLost = "sidecar connection lost"

// Error is an error reply of the sidecar.
type Error struct {
	Code    string
	Message string
}

func (e *Error) Error() string { return "kvhost serve: " + e.Code + ": " + e.Message }

// IsCode reports whether err is an *Error with the code.
func IsCode(err error, code string) bool {
	var e *Error
	return errors.As(err, &e) && e.Code == code
}

// Field is one key and value of a request; Fields keeps their order.
type Field struct {
	K string
	V any
}

// Fields are a request's fields beyond op and seq.
type Fields []Field

// Hello is the sidecar's answer to hello.
type Hello struct {
	Version      [2]int
	Sidecar      string
	Session      string
	Backend      string
	Capabilities []string
	MaxMessage   int64
	Limits       struct{ Ranks, Regions, Rooms int }
}

// Has reports whether the sidecar offers a capability.
func (h *Hello) Has(capability string) bool {
	for _, c := range h.Capabilities {
		if c == capability {
			return true
		}
	}
	return false
}

// Event is one event of the connection. Name is its "event"; the fields
// rooms and reads use are decoded, Raw holds all of them.
type Event struct {
	Name   string
	Rank   uint64
	Room   uint64
	State  int
	Reason string
	Raw    msgpack.Value
	// Local is set on events the client made up itself (connection lost).
	Local bool
}

// link is the transport: one frame per message.
type link interface {
	send(ctx context.Context, msg []byte) error
	recv() ([]byte, error) // blocks until a message or the link closes
	close() error
}

// Client is one connection to a sidecar. Safe for concurrent use.
type Client struct {
	l     link
	hello Hello

	seq     atomic.Uint64
	mu      sync.Mutex
	pending map[uint64]chan reply
	lost    bool
	rooms   map[[2]uint64]bool // (rank, room) in flight, for the lost events

	vllm   vllmTrack // vLLM reads in flight (vllm.go)
	events *eventQueue
	done   chan struct{}
	life   context.Context // cancelled when the connection is lost
	kill   context.CancelFunc
	err    error // why the connection ended (after done)
	closed atomic.Bool
}

type reply struct {
	v   msgpack.Value
	err error
}

// Options configure Dial.
type Options struct {
	// Name is hello's client (default "kvhost-go").
	Name string
}

// Dial connects to the sidecar at endpoint (ipc://path) and says hello. A
// sidecar with another major version answers `version` (an *Error).
func Dial(ctx context.Context, endpoint string, o Options) (*Client, error) {
	l, err := dialLink(ctx, endpoint)
	if err != nil {
		return nil, err
	}
	c := newClient(l)
	if o.Name == "" {
		o.Name = "kvhost-go"
	}
	v, err := c.call(ctx, "hello", Fields{{"version", []int{Major, Minor}}, {"client", o.Name}, {"pid", os.Getpid()}})
	if err != nil {
		c.Close()
		return nil, err
	}
	if err := c.readHello(v); err != nil {
		c.Close()
		return nil, err
	}
	return c, nil
}

func newClient(l link) *Client {
	c := &Client{l: l, pending: make(map[uint64]chan reply), rooms: make(map[[2]uint64]bool),
		events: newEventQueue(), done: make(chan struct{})}
	c.life, c.kill = context.WithCancel(context.Background())
	go c.read()
	return c
}

func (c *Client) readHello(v msgpack.Value) error {
	h := &c.hello
	if ver, ok := v.Get("version"); ok && len(ver.Items) == 2 {
		a, _ := ver.Items[0].Int()
		b, _ := ver.Items[1].Int()
		h.Version = [2]int{int(a), int(b)}
	}
	if h.Version[0] != Major {
		return fmt.Errorf("kvhost serve: sidecar speaks protocol %d.%d, this client %d.%d", h.Version[0], h.Version[1], Major, Minor)
	}
	h.Sidecar = str(v, "sidecar")
	h.Session = str(v, "session")
	h.Backend = str(v, "backend")
	if cs, ok := v.Get("capabilities"); ok {
		for _, x := range cs.Items {
			s, _ := x.Str()
			h.Capabilities = append(h.Capabilities, s)
		}
	}
	h.MaxMessage = i64(v, "max_message")
	if l, ok := v.Get("limits"); ok {
		h.Limits.Ranks = int(i64(l, "ranks"))
		h.Limits.Regions = int(i64(l, "regions"))
		h.Limits.Rooms = int(i64(l, "rooms"))
	}
	return nil
}

// Hello returns the sidecar's hello.
func (c *Client) Hello() Hello { return c.hello }

// Events returns the connection's events, in the order the sidecar sent
// them. The channel is closed after the connection drops (after the
// made-up Failed events of rooms in flight). Events are queued without
// bound on the client side: read them.
func (c *Client) Events() <-chan Event { return c.events.out }

// Done is closed when the connection has dropped or was closed.
func (c *Client) Done() <-chan struct{} { return c.done }

// Err says why the connection ended (after Done).
func (c *Client) Err() error {
	<-c.done
	return c.err
}

// Close closes the connection; requests in flight fail.
func (c *Client) Close() error {
	if c.closed.Swap(true) {
		<-c.done
		return nil
	}
	err := c.l.close()
	<-c.done
	close(c.events.quit)
	return err
}

// read receives replies and events until the link fails.
func (c *Client) read() {
	var err error
	for {
		var b []byte
		b, err = c.l.recv()
		if err != nil {
			break
		}
		v, derr := msgpack.Decode(b)
		if derr != nil || v.Kind != msgpack.Map {
			continue // not the sidecar's: ignore
		}
		if name, ok := v.Get("event"); ok {
			c.event(name, v)
			continue
		}
		sv, _ := v.Get("seq")
		seq, ok := sv.Uint()
		if !ok {
			continue
		}
		c.mu.Lock()
		ch := c.pending[seq]
		delete(c.pending, seq)
		c.mu.Unlock()
		if ch == nil {
			continue
		}
		if okv, _ := v.Get("ok"); okv.Kind == msgpack.Bool {
			if b, _ := okv.Bool(); !b {
				ch <- reply{err: &Error{Code: str(v, "code"), Message: str(v, "message")}}
				continue
			}
		}
		ch <- reply{v: v}
	}
	if c.closed.Load() {
		err = errors.New("kvhost serve: client closed")
	}
	c.kill() // sends in progress stop reconnecting
	c.mu.Lock()
	c.lost = true
	c.err = err
	for seq, ch := range c.pending {
		ch <- reply{err: &Error{Code: CodeDisconnected, Message: fmt.Sprintf("connection to the sidecar lost: %v", err)}}
		delete(c.pending, seq)
	}
	rooms := c.rooms
	c.rooms = nil
	c.mu.Unlock()
	for k := range rooms {
		c.events.push(Event{Name: "room", Rank: k[0], Room: k[1], State: 0, Reason: ReasonConnectionLost, Local: true})
	}
	c.vllmLost()
	c.events.close()
	close(c.done)
}

func (c *Client) event(name msgpack.Value, v msgpack.Value) {
	e := Event{Raw: v}
	e.Name, _ = name.Str()
	e.Rank, _ = u64(v, "rank")
	e.Room, _ = u64(v, "room")
	e.State = int(i64(v, "state"))
	e.Reason = str(v, "reason")
	c.vllmEvent(e)
	if e.Name == "room" && (e.State == StateFailed || e.State == StateSuccess) {
		c.mu.Lock()
		delete(c.rooms, [2]uint64{e.Rank, e.Room})
		c.mu.Unlock()
	}
	c.events.push(e)
}

// track notes a room in flight (for the made-up Failed event when the
// connection drops); untrack forgets it.
func (c *Client) track(rank, room uint64) {
	c.mu.Lock()
	if c.rooms != nil {
		c.rooms[[2]uint64{rank, room}] = true
	}
	c.mu.Unlock()
}

func (c *Client) untrack(rank, room uint64) {
	c.mu.Lock()
	delete(c.rooms, [2]uint64{rank, room})
	c.mu.Unlock()
}

// Call sends op with fields and waits for the reply: the reply map on
// success, an *Error otherwise. Typed methods wrap it; it is exported for
// tests and ops without a typed method.
func (c *Client) Call(ctx context.Context, op string, fields map[string]any) (msgpack.Value, error) {
	f := make(Fields, 0, len(fields))
	for k, v := range fields {
		f = append(f, Field{k, v})
	}
	return c.call(ctx, op, f)
}

func (c *Client) call(ctx context.Context, op string, f Fields) (msgpack.Value, error) {
	return c.start(ctx, op, f).Wait(ctx)
}

// Pending is a request sent and not yet answered (Start).
type Pending struct {
	c   *Client
	op  string
	seq uint64
	ch  chan reply
	err error // the request could not be sent
}

// Start sends a request and returns at once; Wait returns its reply.
// Requests started one after another from one goroutine reach the
// sidecar in that order (it answers them in that order too), so an
// engine may pipeline, say, the chunks of a room without a round trip
// each.
func (c *Client) Start(ctx context.Context, op string, fields map[string]any) *Pending {
	f := make(Fields, 0, len(fields))
	for k, v := range fields {
		f = append(f, Field{k, v})
	}
	return c.start(ctx, op, f)
}

func (c *Client) start(ctx context.Context, op string, f Fields) *Pending {
	p := &Pending{c: c, op: op, seq: c.seq.Add(1), ch: make(chan reply, 1)}
	c.mu.Lock()
	if c.lost {
		c.mu.Unlock()
		p.err = &Error{Code: CodeDisconnected, Message: "connection to the sidecar lost"}
		return p
	}
	c.pending[p.seq] = p.ch
	c.mu.Unlock()
	var e msgpack.Encoder
	e.MapHeader(2 + len(f))
	e.Str("op")
	e.Str(op)
	e.Str("seq")
	e.Uint(p.seq)
	for _, x := range f {
		e.Str(x.K)
		if err := encode(&e, x.V); err != nil {
			p.forget()
			p.err = fmt.Errorf("kvhost serve: %s: field %s: %w", op, x.K, err)
			return p
		}
	}
	// The socket reconnects by itself; a session does not survive that,
	// so a send stops once the connection is lost.
	sctx, cancel := context.WithCancel(ctx)
	stop := context.AfterFunc(c.life, cancel)
	err := c.l.send(sctx, e.Bytes())
	stop()
	cancel()
	if err != nil {
		p.forget()
		if c.life.Err() != nil {
			p.err = &Error{Code: CodeDisconnected, Message: fmt.Sprintf("connection to the sidecar lost: %v", err)}
		} else {
			p.err = fmt.Errorf("kvhost serve: %s: %w", op, err)
		}
	}
	return p
}

func (p *Pending) forget() {
	p.c.mu.Lock()
	delete(p.c.pending, p.seq)
	p.c.mu.Unlock()
}

// Wait waits for the reply: the reply map, or an *Error (CodeDisconnected
// when the connection dropped first), or ctx's error.
func (p *Pending) Wait(ctx context.Context) (msgpack.Value, error) {
	if p.err != nil {
		return msgpack.Value{}, p.err
	}
	select {
	case r := <-p.ch:
		return r.v, r.err
	case <-ctx.Done():
		p.forget()
		return msgpack.Value{}, fmt.Errorf("kvhost serve: %s: %w", p.op, ctx.Err())
	}
}

// SendRaw sends bytes as one message, unchecked (fault tests).
func (c *Client) SendRaw(ctx context.Context, msg []byte) error { return c.l.send(ctx, msg) }

func str(v msgpack.Value, k string) string {
	x, _ := v.Get(k)
	s, _ := x.Str()
	return s
}

func i64(v msgpack.Value, k string) int64 {
	x, _ := v.Get(k)
	n, _ := x.Int()
	return n
}

func u64(v msgpack.Value, k string) (uint64, bool) {
	x, ok := v.Get(k)
	if !ok {
		return 0, false
	}
	return x.Uint()
}

// encode appends v; a type the API has no use for is an error.
func encode(e *msgpack.Encoder, v any) error {
	switch x := v.(type) {
	case nil:
		e.Nil()
	case bool:
		e.Bool(x)
	case int:
		e.Int(int64(x))
	case int64:
		e.Int(x)
	case uint64:
		e.Uint(x)
	case float64:
		e.Float(x)
	case string:
		e.Str(x)
	case []byte:
		if x == nil {
			e.Nil()
			return nil
		}
		e.Bin(x)
	case []int:
		e.ArrayHeader(len(x))
		for _, n := range x {
			e.Int(int64(n))
		}
	case []uint64:
		e.ArrayHeader(len(x))
		for _, n := range x {
			e.Uint(n)
		}
	case []string:
		e.ArrayHeader(len(x))
		for _, s := range x {
			e.Str(s)
		}
	case []any:
		e.ArrayHeader(len(x))
		for _, v := range x {
			if err := encode(e, v); err != nil {
				return err
			}
		}
	case []map[string]any:
		e.ArrayHeader(len(x))
		for _, f := range x {
			if err := encode(e, f); err != nil {
				return err
			}
		}
	case []Fields:
		e.ArrayHeader(len(x))
		for _, f := range x {
			if err := encode(e, f); err != nil {
				return err
			}
		}
	case Fields:
		e.MapHeader(len(x))
		for _, f := range x {
			e.Str(f.K)
			if err := encode(e, f.V); err != nil {
				return fmt.Errorf("%s: %w", f.K, err)
			}
		}
	case map[string]any:
		e.MapHeader(len(x))
		for k, v := range x {
			e.Str(k)
			if err := encode(e, v); err != nil {
				return fmt.Errorf("%s: %w", k, err)
			}
		}
	case msgpack.Value:
		e.Value(x)
	default:
		return fmt.Errorf("cannot encode %T", v)
	}
	return nil
}

// eventQueue is an unbounded FIFO in front of a channel. While the
// channel's buffer has room and nothing is queued, push puts the event
// on the channel itself: the reader hands it to the engine without a
// wakeup of pump (a goroutine hop per event). pump takes over what does
// not fit, in order.
type eventQueue struct {
	mu       sync.Mutex
	q        []Event
	carrying bool // pump holds an event it took from q and has not delivered
	closed   bool
	wake     chan struct{}
	out      chan Event
	quit     chan struct{} // closed by Client.Close: nobody reads any more
}

// eventBuffer is the events the channel holds before pump queues them.
const eventBuffer = 256

func newEventQueue() *eventQueue {
	q := &eventQueue{wake: make(chan struct{}, 1), out: make(chan Event, eventBuffer), quit: make(chan struct{})}
	go q.pump()
	return q
}

func (q *eventQueue) push(e Event) {
	q.mu.Lock()
	if len(q.q) == 0 && !q.carrying {
		// Every earlier event is on the channel already: order holds.
		select {
		case q.out <- e:
			q.mu.Unlock()
			return
		default:
		}
	}
	q.q = append(q.q, e)
	q.mu.Unlock()
	select {
	case q.wake <- struct{}{}:
	default:
	}
}

func (q *eventQueue) close() {
	q.mu.Lock()
	q.closed = true
	q.mu.Unlock()
	select {
	case q.wake <- struct{}{}:
	default:
	}
}

func (q *eventQueue) pump() {
	for {
		q.mu.Lock()
		if len(q.q) == 0 {
			closed := q.closed
			q.mu.Unlock()
			if closed {
				close(q.out)
				return
			}
			select {
			case <-q.wake:
			case <-q.quit:
				return
			}
			continue
		}
		e := q.q[0]
		q.q[0] = Event{}
		q.q = q.q[1:]
		q.carrying = true
		q.mu.Unlock()
		select {
		case q.out <- e:
		case <-q.quit:
			return
		}
		q.mu.Lock()
		q.carrying = false
		q.mu.Unlock()
	}
}
