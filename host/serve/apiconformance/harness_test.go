package apiconformance

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/kvhost/kvhost/host/internal/msgpack"
	"github.com/kvhost/kvhost/host/internal/zmq"
)

var kvhostFlag = flag.String("kvhost", "", "the kvhost binary under test (default $KVHOST_CONFORMANCE_BIN, else bin/kvhost of this checkout)")

// wait bounds how long a check waits for something the sidecar must do
// (a reply, an event): generous, so a loaded machine cannot fail a check
// by itself; a broken promise fails it by never happening.
const wait = 60 * time.Second

// quiet is how long a check listens for something that must NOT arrive.
// A broken promise that sends it sends it at once, so a short window
// catches it on an idle machine; on a loaded one the check may miss it
// but cannot fail wrongly.
const quiet = 300 * time.Millisecond

// binary is the sidecar under test.
func binary(t testing.TB) string {
	t.Helper()
	p := *kvhostFlag
	if p == "" {
		p = os.Getenv("KVHOST_CONFORMANCE_BIN")
	}
	if p == "" {
		wd, err := os.Getwd()
		if err != nil {
			t.Fatal(err)
		}
		for d := wd; ; d = filepath.Dir(d) {
			if _, err := os.Stat(filepath.Join(d, "go.mod")); err == nil {
				p = filepath.Join(d, "bin", "kvhost")
				break
			}
			if filepath.Dir(d) == d {
				t.Fatalf("no go.mod above %s: name the binary under test with KVHOST_CONFORMANCE_BIN", wd)
			}
		}
	}
	if _, err := os.Stat(p); err != nil {
		t.Fatalf("the sidecar under test: %v (build it with make, or name one with KVHOST_CONFORMANCE_BIN or -kvhost)", err)
	}
	return p
}

// sidecar is a running `kvhost serve` process.
type sidecar struct {
	t        testing.TB
	cmd      *exec.Cmd
	endpoint string
	sock     string
	done     chan struct{}
	err      error // Wait's, once done
	mu       sync.Mutex
	log      bytes.Buffer
}

func (s *sidecar) Write(b []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.log.Write(b)
}

func (s *sidecar) logText() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.log.String()
}

// startSidecar runs `kvhost --backend fake serve` on a fresh ipc socket
// with extra flags and waits until it prints its endpoint.
func startSidecar(t testing.TB, extra ...string) *sidecar {
	t.Helper()
	dir, err := os.MkdirTemp("", "kvac-") // short: ipc paths are limited to 107 bytes
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	s := &sidecar{t: t, sock: filepath.Join(dir, "s.sock"), done: make(chan struct{})}
	args := append([]string{"--backend", "fake", "--log-level", "debug", "serve", "--control", "ipc://" + s.sock}, extra...)
	s.cmd = exec.Command(binary(t), args...)
	s.cmd.Stderr = s
	out, err := s.cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := s.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	first := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(out)
		n := 0
		for sc.Scan() {
			if n == 0 {
				first <- sc.Text()
			}
			n++
			fmt.Fprintln(s, "stdout:", sc.Text())
		}
		close(first)
		s.err = s.cmd.Wait()
		close(s.done)
	}()
	t.Cleanup(func() {
		s.cmd.Process.Kill()
		<-s.done
		if t.Failed() {
			t.Logf("sidecar %s output:\n%s", s.sock, s.logText())
		}
	})
	select {
	case ep, ok := <-first:
		if !ok {
			t.Fatalf("the sidecar exited before it served:\n%s", s.logText())
		}
		s.endpoint = ep
	case <-time.After(wait):
		t.Fatalf("the sidecar printed no endpoint:\n%s", s.logText())
	}
	if s.endpoint != "ipc://"+s.sock {
		t.Fatalf("the sidecar serves %q, want ipc://%s", s.endpoint, s.sock)
	}
	return s
}

// exited waits for the process to end and returns Wait's error.
func (s *sidecar) exited() error {
	s.t.Helper()
	select {
	case <-s.done:
		return s.err
	case <-time.After(wait):
		s.t.Fatalf("the sidecar did not exit:\n%s", s.logText())
		return nil
	}
}

// maps is the sidecar's /proc/PID/maps: which shared memory it maps.
func (s *sidecar) maps() string {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/maps", s.cmd.Process.Pid))
	if err != nil {
		s.t.Fatal(err)
	}
	return string(b)
}

// waitUnmapped waits until the sidecar no longer maps the file at path.
func (s *sidecar) waitUnmapped(path string) {
	s.t.Helper()
	deadline := time.Now().Add(wait)
	for strings.Contains(s.maps(), path) {
		if time.Now().After(deadline) {
			s.t.Fatalf("the sidecar still maps %s", path)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// M is a msgpack map written in its order; F one of its entries.
type M []F

// F is one key and value of a map.
type F struct {
	K string
	V any
}

// m builds a map from key, value pairs.
func m(kv ...any) M {
	if len(kv)%2 != 0 {
		panic("m: odd number of arguments")
	}
	out := make(M, 0, len(kv)/2)
	for i := 0; i < len(kv); i += 2 {
		out = append(out, F{kv[i].(string), kv[i+1]})
	}
	return out
}

// with returns a copy of x with key set to v (replaced, or appended).
func (x M) with(key string, v any) M {
	out := make(M, 0, len(x)+1)
	found := false
	for _, f := range x {
		if f.K == key {
			f.V, found = v, true
		}
		out = append(out, f)
	}
	if !found {
		out = append(out, F{key, v})
	}
	return out
}

// without returns a copy of x without key.
func (x M) without(key string) M {
	out := make(M, 0, len(x))
	for _, f := range x {
		if f.K != key {
			out = append(out, f)
		}
	}
	return out
}

func encode(v any) []byte {
	var e msgpack.Encoder
	put(&e, v)
	return e.Bytes()
}

func put(e *msgpack.Encoder, v any) {
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
		e.Bin(x)
	case []uint64:
		e.ArrayHeader(len(x))
		for _, n := range x {
			e.Uint(n)
		}
	case []int:
		e.ArrayHeader(len(x))
		for _, n := range x {
			e.Int(int64(n))
		}
	case []any:
		e.ArrayHeader(len(x))
		for _, it := range x {
			put(e, it)
		}
	case M:
		e.MapHeader(len(x))
		for _, f := range x {
			e.Str(f.K)
			put(e, f.V)
		}
	case msgpack.Value:
		e.Value(x)
	default:
		panic(fmt.Sprintf("put: %T", v))
	}
}

// i32s packs page or block indices as little-endian int32 (bin).
func i32s(xs ...int) []byte {
	b := make([]byte, 4*len(xs))
	for i, x := range xs {
		b[4*i], b[4*i+1], b[4*i+2], b[4*i+3] = byte(x), byte(x>>8), byte(x>>16), byte(x>>24)
	}
	return b
}

// u64s packs room ids as little-endian uint64 (bin).
func u64s(xs ...uint64) []byte {
	b := make([]byte, 8*len(xs))
	for i, x := range xs {
		for k := range 8 {
			b[8*i+k] = byte(x >> (8 * k))
		}
	}
	return b
}

// conn is one engine connection: a DEALER socket. It reads replies and
// events in arrival order into inbox and checks, for every reply, that
// its seq was sent and is answered once only.
type conn struct {
	t        testing.TB
	name     string
	d        *zmq.Dealer
	seq      uint64
	inbox    []msgpack.Value
	sent     map[uint64]bool
	answered map[uint64]bool
	gone     bool // the sidecar closed the connection
	closed   bool
}

// dial connects a DEALER to the sidecar, without hello.
func (s *sidecar) dial(t testing.TB, name string, opts ...zmq.Option) *conn {
	t.Helper()
	opts = append([]zmq.Option{zmq.WithLogger(slog.New(slog.NewTextHandler(io.Discard, nil))),
		zmq.WithMaxMessageSize(1 << 30), zmq.WithRecvBudget(1 << 30)}, opts...)
	d, err := zmq.DialDealer(s.endpoint, opts...)
	if err != nil {
		t.Fatal(err)
	}
	c := &conn{t: t, name: name, d: d, seq: 100, sent: map[uint64]bool{}, answered: map[uint64]bool{}}
	t.Cleanup(c.close)
	return c
}

// engine connects and says hello.
func (s *sidecar) engine(t testing.TB, name string) *conn {
	t.Helper()
	c := s.dial(t, name)
	c.ok("hello", m("version", []int{1, 0}, "client", name, "pid", os.Getpid()))
	return c
}

func (c *conn) close() {
	if !c.closed {
		c.closed = true
		c.d.Close()
	}
}

// frames sends one raw message.
func (c *conn) frames(fs ...[]byte) {
	c.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), wait)
	defer cancel()
	if err := c.d.Send(ctx, fs...); err != nil {
		c.t.Fatalf("%s: send: %v", c.name, err)
	}
}

// send sends op with the next seq and returns the seq.
func (c *conn) send(op string, f M) uint64 {
	c.t.Helper()
	c.seq++
	c.sent[c.seq] = true
	c.frames(encode(append(M{{"op", op}, {"seq", c.seq}}, f...)))
	return c.seq
}

// pump reads one message into inbox; false when none came within d or
// the connection ended.
func (c *conn) pump(d time.Duration) bool {
	c.t.Helper()
	if c.gone {
		return false
	}
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	fs, err := c.d.Recv(ctx)
	switch {
	case errors.Is(err, zmq.ErrDisconnected):
		c.gone = true
		return false
	case err != nil:
		return false
	}
	if len(fs) != 1 {
		c.t.Errorf("%s: a message of %d frames; the API sends one", c.name, len(fs))
		return true
	}
	v, derr := msgpack.Decode(fs[0])
	if derr != nil || v.Kind != msgpack.Map {
		c.t.Errorf("%s: a message that is not a msgpack map: %x", c.name, fs[0])
		return true
	}
	if _, ev := v.Get("event"); !ev {
		sv, ok := v.Get("seq")
		if !ok {
			c.t.Errorf("%s: a reply without seq: %s", c.name, show(v))
		} else if seq, isU := sv.Uint(); isU {
			if !c.sent[seq] {
				c.t.Errorf("%s: a reply to seq %d, which was never sent: %s", c.name, seq, show(v))
			} else if c.answered[seq] {
				c.t.Errorf("%s: a second reply to seq %d: %s", c.name, seq, show(v))
			}
			c.answered[seq] = true
		} else if sv.Kind != msgpack.Nil {
			c.t.Errorf("%s: seq is %v, want a uint or nil: %s", c.name, sv.Kind, show(v))
		}
	}
	c.inbox = append(c.inbox, v)
	return true
}

// take removes and returns the first inbox message match accepts,
// reading more for up to d.
func (c *conn) take(d time.Duration, match func(msgpack.Value) bool) (msgpack.Value, bool) {
	deadline := time.Now().Add(d)
	for i := 0; ; {
		for ; i < len(c.inbox); i++ {
			if match(c.inbox[i]) {
				v := c.inbox[i]
				c.inbox = append(c.inbox[:i:i], c.inbox[i+1:]...)
				return v, true
			}
		}
		left := time.Until(deadline)
		if left <= 0 || c.gone {
			return msgpack.Value{}, false
		}
		c.pump(left)
	}
}

func isReplyTo(seq uint64) func(msgpack.Value) bool {
	return func(v msgpack.Value) bool {
		if _, ev := v.Get("event"); ev {
			return false
		}
		sv, _ := v.Get("seq")
		n, ok := sv.Uint()
		return ok && n == seq
	}
}

func isNilSeqReply(v msgpack.Value) bool {
	if _, ev := v.Get("event"); ev {
		return false
	}
	sv, ok := v.Get("seq")
	return ok && sv.Kind == msgpack.Nil
}

// reply waits for the reply to seq.
func (c *conn) reply(seq uint64) msgpack.Value {
	c.t.Helper()
	v, ok := c.take(wait, isReplyTo(seq))
	if !ok {
		c.t.Fatalf("%s: no reply to seq %d (connection gone: %v)", c.name, seq, c.gone)
	}
	return v
}

// nilReply waits for a reply whose seq is nil.
func (c *conn) nilReply() msgpack.Value {
	c.t.Helper()
	v, ok := c.take(wait, isNilSeqReply)
	if !ok {
		c.t.Fatalf("%s: no reply with seq nil (connection gone: %v)", c.name, c.gone)
	}
	return v
}

// wantOK checks that v is a success reply.
func (c *conn) wantOK(what string, v msgpack.Value) msgpack.Value {
	c.t.Helper()
	if b, _ := boolOf(v, "ok"); !b {
		c.t.Fatalf("%s: %s: want ok, got %s", c.name, what, show(v))
	}
	return v
}

// wantErr checks that v is an error reply with code whose message holds
// every one of subs.
func (c *conn) wantErr(what string, v msgpack.Value, code string, subs ...string) msgpack.Value {
	c.t.Helper()
	ok, isBool := boolOf(v, "ok")
	got := strOf(v, "code")
	msg := strOf(v, "message")
	if !isBool || ok || got != code {
		c.t.Fatalf("%s: %s: want error %s, got %s", c.name, what, code, show(v))
	}
	for _, s := range subs {
		if !strings.Contains(msg, s) {
			c.t.Fatalf("%s: %s: error %s %q does not say %q", c.name, what, code, msg, s)
		}
	}
	if v.Len() != 4 {
		c.t.Fatalf("%s: %s: an error reply is {seq, ok, code, message}, got %s", c.name, what, show(v))
	}
	return v
}

// ok sends op and wants a success reply.
func (c *conn) ok(op string, f M) msgpack.Value {
	c.t.Helper()
	return c.wantOK(op, c.reply(c.send(op, f)))
}

// fail sends op and wants the error code, its message naming subs.
func (c *conn) fail(op string, f M, code string, subs ...string) msgpack.Value {
	c.t.Helper()
	return c.wantErr(op, c.reply(c.send(op, f)), code, subs...)
}

// event waits for the first event named name that match accepts (nil:
// any).
func (c *conn) event(name string, match func(msgpack.Value) bool) msgpack.Value {
	c.t.Helper()
	v, ok := c.take(wait, isEvent(name, match))
	if !ok {
		c.t.Fatalf("%s: no %s event (connection gone: %v; inbox %s)", c.name, name, c.gone, showAll(c.inbox))
	}
	return v
}

// seen waits until such an event has arrived and returns it, leaving it
// in the inbox (for a later check of the whole sequence).
func (c *conn) seen(name string, match func(msgpack.Value) bool) msgpack.Value {
	c.t.Helper()
	deadline := time.Now().Add(wait)
	for {
		for _, v := range c.inbox {
			if isEvent(name, match)(v) {
				return v
			}
		}
		if c.gone || time.Now().After(deadline) {
			c.t.Fatalf("%s: no %s event (connection gone: %v; inbox %s)", c.name, name, c.gone, showAll(c.inbox))
		}
		c.pump(time.Until(deadline))
	}
}

// noEvent checks that no such event is waiting or arrives within quiet.
func (c *conn) noEvent(name string, match func(msgpack.Value) bool) {
	c.t.Helper()
	if v, ok := c.take(quiet, isEvent(name, match)); ok {
		c.t.Fatalf("%s: unexpected event %s", c.name, show(v))
	}
}

func isEvent(name string, match func(msgpack.Value) bool) func(msgpack.Value) bool {
	return func(v msgpack.Value) bool {
		if strOf(v, "event") != name {
			return false
		}
		return match == nil || match(v)
	}
}

// roomEvent matches a room event of (rank, room) in state st (-1: any).
func roomEvent(rank, room uint64, st int) func(msgpack.Value) bool {
	return func(v msgpack.Value) bool {
		r, _ := uintOf(v, "rank")
		n, _ := uintOf(v, "room")
		s, _ := uintOf(v, "state")
		return r == rank && n == room && (st < 0 || int(s) == st)
	}
}

// waitGone waits until the sidecar closed the connection.
func (c *conn) waitGone() {
	c.t.Helper()
	deadline := time.Now().Add(wait)
	for !c.gone {
		if time.Now().After(deadline) {
			c.t.Fatalf("%s: the sidecar did not close the connection", c.name)
		}
		c.pump(time.Second)
	}
}

func strOf(v msgpack.Value, k string) string {
	x, _ := v.Get(k)
	s, _ := x.Str()
	return s
}

func uintOf(v msgpack.Value, k string) (uint64, bool) {
	x, _ := v.Get(k)
	return x.Uint()
}

func boolOf(v msgpack.Value, k string) (bool, bool) {
	x, _ := v.Get(k)
	return x.Bool()
}

func binOf(v msgpack.Value, k string) []byte {
	x, _ := v.Get(k)
	b, _ := x.Bin()
	return b
}

// must reads a uint field of a reply or event.
func must(t testing.TB, v msgpack.Value, k string) uint64 {
	t.Helper()
	n, ok := uintOf(v, k)
	if !ok {
		t.Fatalf("field %q missing or not a uint in %s", k, show(v))
	}
	return n
}

// show renders a message for failure output.
func show(v msgpack.Value) string {
	var b strings.Builder
	render(&b, v)
	return b.String()
}

func showAll(vs []msgpack.Value) string {
	parts := make([]string, len(vs))
	for i, v := range vs {
		parts[i] = show(v)
	}
	return "[" + strings.Join(parts, ", ") + "]"
}

func render(b *strings.Builder, v msgpack.Value) {
	switch v.Kind {
	case msgpack.Map:
		b.WriteString("{")
		first := true
		v.Each(func(k string, x msgpack.Value) bool {
			if !first {
				b.WriteString(", ")
			}
			first = false
			b.WriteString(k + ": ")
			render(b, x)
			return true
		})
		b.WriteString("}")
	case msgpack.Array:
		b.WriteString("[")
		for i := range v.Len() {
			if i > 0 {
				b.WriteString(", ")
			}
			x, _ := v.Index(i)
			render(b, x)
		}
		b.WriteString("]")
	case msgpack.Str:
		s, _ := v.Str()
		fmt.Fprintf(b, "%q", s)
	case msgpack.Bin:
		x, _ := v.Bin()
		fmt.Fprintf(b, "bin(%x)", x)
	case msgpack.Nil:
		b.WriteString("nil")
	case msgpack.Bool:
		x, _ := v.Bool()
		fmt.Fprint(b, x)
	case msgpack.Float:
		x, _ := v.Float()
		fmt.Fprint(b, x)
	default:
		if n, ok := v.Uint(); ok {
			fmt.Fprint(b, n)
		} else if n, ok := v.Int(); ok {
			fmt.Fprint(b, n)
		} else {
			fmt.Fprint(b, v.Kind)
		}
	}
}

var shmSeq atomic.Int64

// shm is a POSIX shared-memory object the test engine owns and maps.
type shm struct {
	name string // POSIX name, "/kvac-..."
	path string
	mem  []byte
}

func newSHM(t testing.TB, size int) *shm {
	t.Helper()
	name := fmt.Sprintf("/kvac-%d-%d", os.Getpid(), shmSeq.Add(1))
	path := "/dev/shm" + name
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	t.Cleanup(func() { os.Remove(path) })
	if err := f.Truncate(int64(size)); err != nil {
		t.Fatal(err)
	}
	mem, err := syscall.Mmap(int(f.Fd()), 0, size, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_SHARED)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { syscall.Munmap(mem) })
	return &shm{name: name, path: path, mem: mem}
}

var addrSeq atomic.Uint64

// engineAddr is a fresh engine pointer: the sidecar only translates
// pointers into its own mapping, so any address range works as long as
// one connection's regions do not overlap.
func engineAddr() uint64 { return 0x7e0000000000 + addrSeq.Add(1)<<32 }

// region is a dram region of register_memory.
func region(addr uint64, length int, name string) M {
	return m("kind", "dram", "addr", addr, "length", uint64(length), "shm", name)
}

// register registers regions and returns their ids.
func (c *conn) register(regions ...M) []uint64 {
	c.t.Helper()
	rs := make([]any, len(regions))
	for i, r := range regions {
		rs[i] = r
	}
	v := c.ok("register_memory", m("regions", rs))
	x, _ := v.Get("regions")
	var ids []uint64
	for i := range x.Len() {
		it, _ := x.Index(i)
		n, ok := it.Uint()
		if !ok {
			c.t.Fatalf("register_memory: region id %s is not a uint", show(it))
		}
		ids = append(ids, n)
	}
	if len(ids) != len(regions) {
		c.t.Fatalf("register_memory: %d ids for %d regions", len(ids), len(regions))
	}
	return ids
}
