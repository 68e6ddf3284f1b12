package bootstrap

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strconv"
	"sync"
	"time"

	"github.com/kvhost/kvhost/host/internal/ratelog"
)

// DefaultEntryTTL is how long a room's registered DP rank is kept
// (SGLANG_DISAGGREGATION_BOOTSTRAP_ENTRY_CLEANUP_INTERVAL, 120 s).
const DefaultEntryTTL = 120 * time.Second

// maxBody bounds request bodies.
const maxBody = 1 << 20

// maxRanks bounds the prefill ranks a layout may declare (dp × cp × tp ×
// pp). Real deployments have hundreds; the bound keeps the product far
// from overflowing, which would make an incomplete layout look ready.
const maxRanks = 1 << 20

// httpLimits are the listening server's timeouts and header cap: a client
// that trickles its headers or body, or never reads its response, is
// disconnected instead of holding a connection and a goroutine.
type httpLimits struct {
	readHeader, read, write, idle time.Duration
	maxHeaderBytes                int
	// closeGrace is how long Close waits for requests in flight before it
	// drops them. Every handler answers from memory in microseconds, so
	// only a stalled client (trickling its body, not reading its answer)
	// is still in flight after a few milliseconds.
	closeGrace time.Duration
}

var defaultHTTPLimits = httpLimits{
	readHeader:     10 * time.Second,
	read:           30 * time.Second,
	write:          30 * time.Second,
	idle:           2 * time.Minute,
	maxHeaderBytes: 64 << 10,
	closeGrace:     250 * time.Millisecond,
}

// rankKey identifies a prefill rank: DP group, CP rank, TP rank, PP rank.
type rankKey struct{ dp, cp, tp, pp int }

// layout is the deployment shape, fixed by the first registration.
type layout struct {
	attnTP, attnCP, dp, pp int
	pageSize               int
	kvCacheDType           *string
	followBootstrapRoom    bool
	dsaLayerSplit          bool
	prefillHTTPPort        *int
}

// Server is the bootstrap HTTP handler (prefill side). The zero value is
// not usable; call NewServer. Safe for concurrent use.
//
// Differences from SGLang's server, all in the direction of clearer
// errors: malformed requests get 400 with a message (SGLang answers 500);
// a registration that contradicts the layout fixed by the first one gets
// 409 (SGLang silently keeps the first); and readiness counts distinct
// ranks (SGLang counts PUTs, so a rank registering twice could make an
// incomplete deployment look ready).
type Server struct {
	// log is rate-limited (ratelog): a client can trigger its lines.
	log  *slog.Logger
	rlog *ratelog.Logger
	ttl  time.Duration
	now  func() time.Time

	limits httpLimits // for Start

	mu        sync.Mutex
	layout    *layout
	ranks     map[rankKey]RankInfo
	roomDP    map[uint64]roomEntry
	lastPurge time.Time
	// complete is set once every rank of the layout registered, and
	// stays set when ranks deregister (Deregister): the deployment was
	// up, so decodes get its layout and a 404 for a rank that is gone
	// (they fail that room at once) instead of a 503 they would retry.
	complete bool
}

type roomEntry struct {
	dp int
	at time.Time
}

// ServerOption configures a Server.
type ServerOption func(*Server)

// WithLogger sets the server's logger (default slog.Default()).
func WithLogger(l *slog.Logger) ServerOption {
	return func(s *Server) {
		if l != nil {
			s.log = l
		}
	}
}

// WithEntryTTL sets how long /register_dp_rank entries live.
func WithEntryTTL(d time.Duration) ServerOption {
	return func(s *Server) {
		if d > 0 {
			s.ttl = d
		}
	}
}

// withHTTPLimits shortens Start's timeouts in tests.
func withHTTPLimits(l httpLimits) ServerOption { return func(s *Server) { s.limits = l } }

// withClock replaces time.Now in tests.
func withClock(now func() time.Time) ServerOption { return func(s *Server) { s.now = now } }

// NewServer returns an empty bootstrap server.
func NewServer(opts ...ServerOption) *Server {
	s := &Server{
		log:    slog.Default(),
		ttl:    DefaultEntryTTL,
		now:    time.Now,
		limits: defaultHTTPLimits,
		ranks:  make(map[rankKey]RankInfo),
		roomDP: make(map[uint64]roomEntry),
	}
	for _, o := range opts {
		o(s)
	}
	s.rlog = ratelog.New(s.log)
	s.log = s.rlog.With("component", "bootstrap_server")
	return s
}

// ServeHTTP implements http.Handler.
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	switch r.URL.Path {
	case "/route":
		switch r.Method {
		case http.MethodPut:
			s.handleRegister(w, r)
		case http.MethodGet:
			s.handleRoute(w, r)
		default:
			w.Header().Set("Allow", "GET, PUT")
			text(w, http.StatusMethodNotAllowed, "Method not allowed")
		}
	case "/health":
		if r.Method != http.MethodGet && r.Method != http.MethodHead {
			text(w, http.StatusMethodNotAllowed, "Method not allowed")
			return
		}
		if msg := s.lost(); msg != "" {
			text(w, http.StatusServiceUnavailable, msg)
			return
		}
		text(w, http.StatusOK, "OK")
	case "/register_dp_rank":
		if r.Method != http.MethodPost {
			text(w, http.StatusMethodNotAllowed, "Method not allowed")
			return
		}
		s.handleRegisterDPRank(w, r)
	case "/query_dp_ranks":
		if r.Method != http.MethodPost {
			text(w, http.StatusMethodNotAllowed, "Method not allowed")
			return
		}
		s.handleQueryDPRanks(w, r)
	default:
		text(w, http.StatusNotFound, "Not Found")
	}
}

func text(w http.ResponseWriter, code int, msg string) {
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	w.WriteHeader(code)
	io.WriteString(w, msg)
}

func writeJSON(w http.ResponseWriter, v any) {
	b, err := json.Marshal(v)
	if err != nil {
		text(w, http.StatusInternalServerError, err.Error())
		return
	}
	w.Header().Set("Content-Type", "application/json; charset=utf-8")
	w.WriteHeader(http.StatusOK)
	w.Write(b)
}

// readObject reads a JSON object body into raw fields.
func readObject(w http.ResponseWriter, r *http.Request) (map[string]json.RawMessage, error) {
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, maxBody))
	if err != nil {
		return nil, fmt.Errorf("reading body: %w", err)
	}
	var obj map[string]json.RawMessage
	if err := json.Unmarshal(body, &obj); err != nil {
		return nil, fmt.Errorf("body is not a JSON object: %w", err)
	}
	if obj == nil {
		return nil, errors.New("body is not a JSON object: null")
	}
	return obj, nil
}

// fieldReader extracts typed fields from a JSON object; the first error
// sticks.
type fieldReader struct {
	obj map[string]json.RawMessage
	err error
}

func (f *fieldReader) int(key string, required bool) (int, bool) {
	raw, ok := f.obj[key]
	if !ok {
		if required && f.err == nil {
			f.err = fmt.Errorf("missing field %q", key)
		}
		return 0, false
	}
	var v pyInt
	if err := json.Unmarshal(raw, &v); err != nil {
		if f.err == nil {
			f.err = fmt.Errorf("field %q: %w", key, err)
		}
		return 0, false
	}
	if !v.set {
		if required && f.err == nil {
			f.err = fmt.Errorf("field %q is null", key)
		}
		return 0, false
	}
	if v.v < -1<<31 || v.v > 1<<31-1 {
		if f.err == nil {
			f.err = fmt.Errorf("field %q: %d out of range", key, v.v)
		}
		return 0, false
	}
	return int(v.v), true
}

func (f *fieldReader) string(key string, required bool) (*string, bool) {
	raw, ok := f.obj[key]
	if !ok {
		if required && f.err == nil {
			f.err = fmt.Errorf("missing field %q", key)
		}
		return nil, false
	}
	var v *string
	if err := json.Unmarshal(raw, &v); err != nil && f.err == nil {
		f.err = fmt.Errorf("field %q: want a string: %w", key, err)
	}
	return v, ok
}

func (f *fieldReader) bool(key string) bool {
	raw, ok := f.obj[key]
	if !ok {
		return false
	}
	var v any
	if err := json.Unmarshal(raw, &v); err != nil && f.err == nil {
		f.err = fmt.Errorf("field %q: %w", key, err)
	}
	// Python's bool(): false, null, 0, "" and empty containers are false.
	switch x := v.(type) {
	case bool:
		return x
	case float64:
		return x != 0
	case string:
		return x != ""
	case nil:
		return false
	case []any:
		return len(x) > 0
	case map[string]any:
		return len(x) > 0
	}
	return false
}

func (s *Server) handleRegister(w http.ResponseWriter, r *http.Request) {
	obj, err := readObject(w, r)
	if err != nil {
		s.badRequest(w, r, err)
		return
	}
	f := &fieldReader{obj: obj}
	get := func(k string) int { v, _ := f.int(k, true); return v }
	attnTP, attnTPRank := get("attn_tp_size"), get("attn_tp_rank")
	attnCP, attnCPRank := get("attn_cp_size"), get("attn_cp_rank")
	attnDP, attnDPRank := get("attn_dp_size"), get("attn_dp_rank")
	pp, ppRank := get("pp_size"), get("pp_rank")
	sysDP, sysDPRank := get("system_dp_size"), get("system_dp_rank")
	ip, _ := f.string("rank_ip", true)
	port := get("rank_port")
	pageSize := get("page_size")
	kvDType, _ := f.string("kv_cache_dtype", true)
	httpPort, hasHTTPPort := f.int("prefill_http_port", false)
	lbm := "follow_bootstrap_room"
	if v, ok := f.string("load_balance_method", false); ok && v != nil {
		lbm = *v
	}
	dsa := f.bool("enable_dsa_cache_layer_split")
	if f.err != nil {
		s.badRequest(w, r, f.err)
		return
	}
	if ip == nil || *ip == "" {
		s.badRequest(w, r, errors.New(`field "rank_ip" must be a non-empty string`))
		return
	}
	// dp size and this rank's DP group, as SGLang computes them.
	dpSize, dpGroup := attnDP, attnDPRank
	if sysDP != 1 {
		dpSize, dpGroup = sysDP, sysDPRank
	}
	for _, c := range []struct {
		name       string
		rank, size int
	}{{"attn_tp", attnTPRank, attnTP}, {"attn_cp", attnCPRank, attnCP}, {"dp", dpGroup, dpSize}, {"pp", ppRank, pp}} {
		if c.size < 1 || c.rank < 0 || c.rank >= c.size {
			s.badRequest(w, r, fmt.Errorf("%s rank %d outside size %d", c.name, c.rank, c.size))
			return
		}
	}
	// Sizes are at least 1 and below 2^31 here, so the running product
	// stays below 2^51 until it passes the bound.
	ranks := int64(1)
	for _, size := range []int{attnTP, attnCP, dpSize, pp} {
		if ranks *= int64(size); ranks > maxRanks {
			s.badRequest(w, r, fmt.Errorf("layout of attn_tp %d x attn_cp %d x dp %d x pp %d ranks exceeds %d", attnTP, attnCP, dpSize, pp, maxRanks))
			return
		}
	}
	if port < 1 || port > 65535 {
		s.badRequest(w, r, fmt.Errorf("rank_port %d out of range", port))
		return
	}
	want := layout{
		attnTP: attnTP, attnCP: attnCP, dp: dpSize, pp: pp, pageSize: pageSize, kvCacheDType: kvDType,
		followBootstrapRoom: lbm == "follow_bootstrap_room", dsaLayerSplit: dsa,
	}
	if hasHTTPPort {
		want.prefillHTTPPort = &httpPort
	}
	key := rankKey{dp: dpGroup, cp: attnCPRank, tp: attnTPRank, pp: ppRank}

	s.mu.Lock()
	if s.layout != nil && len(s.ranks) == 0 && s.layout.conflict(&want) != nil {
		// Every rank of the old deployment deregistered: this is
		// another one starting, which may have another layout.
		s.layout, s.complete = nil, false
	}
	if s.layout == nil {
		s.layout = &want
	} else if err := s.layout.conflict(&want); err != nil {
		s.mu.Unlock()
		s.log.Warn("bootstrap registration conflicts with the deployment layout", "remote", r.RemoteAddr, "err", err)
		text(w, http.StatusConflict, "Registration conflicts with the registered prefill layout: "+err.Error())
		return
	}
	if s.layout.prefillHTTPPort == nil && want.prefillHTTPPort != nil {
		s.layout.prefillHTTPPort = want.prefillHTTPPort
	}
	prev, again := s.ranks[key]
	s.ranks[key] = RankInfo{RankIP: *ip, RankPort: port}
	registered, expected := len(s.ranks), s.layout.expected()
	if registered >= expected {
		s.complete = true
	}
	s.mu.Unlock()

	if again && prev != s.ranks[key] {
		s.log.Info("prefill rank re-registered at a new address", "dp", key.dp, "cp", key.cp, "tp", key.tp, "pp", key.pp,
			"old", fmt.Sprintf("%s:%d", prev.RankIP, prev.RankPort), "new", fmt.Sprintf("%s:%d", *ip, port))
	}
	s.log.Debug("prefill rank registered", "dp", key.dp, "cp", key.cp, "tp", key.tp, "pp", key.pp,
		"rank_ip", *ip, "rank_port", port, "registered", registered, "expected", expected)
	text(w, http.StatusOK, "OK")
}

func (l *layout) expected() int { return l.dp * l.attnCP * l.attnTP * l.pp }

// conflict reports how o disagrees with the fixed layout.
func (l *layout) conflict(o *layout) error {
	for _, c := range []struct {
		name      string
		have, got int
	}{{"attn_tp_size", l.attnTP, o.attnTP}, {"attn_cp_size", l.attnCP, o.attnCP}, {"dp_size", l.dp, o.dp},
		{"pp_size", l.pp, o.pp}, {"page_size", l.pageSize, o.pageSize}} {
		if c.have != c.got {
			return fmt.Errorf("%s %d, registered ranks have %d", c.name, c.got, c.have)
		}
	}
	if (l.kvCacheDType == nil) != (o.kvCacheDType == nil) || (l.kvCacheDType != nil && *l.kvCacheDType != *o.kvCacheDType) {
		return fmt.Errorf("kv_cache_dtype %s, registered ranks have %s", strOrNull(o.kvCacheDType), strOrNull(l.kvCacheDType))
	}
	return nil
}

func strOrNull(s *string) string {
	if s == nil {
		return "null"
	}
	return strconv.Quote(*s)
}

// Ready reports whether every prefill rank of the layout registered.
func (s *Server) Ready() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.layout != nil && len(s.ranks) >= s.layout.expected()
}

// readyLocked reports whether the server answers route queries: every
// rank registered, now or before some deregistered (complete).
func (s *Server) readyLocked() bool {
	return s.layout != nil && (s.complete || len(s.ranks) >= s.layout.expected())
}

// Deregister removes a prefill rank that is gone (its engine exited or
// closed it), if the server holds it at the address reg names: a rank
// that registered again elsewhere since is kept. Decodes asking for it
// then get 404 and fail that room at once, as SGLang's decode does on
// any answer but 200 (CommonKVReceiver._get_bootstrap_info_from_server),
// instead of sending to a socket nobody reads; and /health answers 503
// until the deployment is whole again, so decodes that cached the rank's
// address learn it from their heartbeat (SGLang's heartbeat counts any
// answer but 200 as a failure, then fails the prefill's rooms and drops
// what it cached). SGLang's own server has no such route: its ranks live
// in the process that serves it and die with it. It reports whether the
// rank was removed.
func (s *Server) Deregister(reg Registration) bool {
	dpGroup := reg.AttnDPRank
	if reg.SystemDPSize != 1 {
		dpGroup = reg.SystemDPRank
	}
	key := rankKey{dp: dpGroup, cp: reg.AttnCPRank, tp: reg.AttnTPRank, pp: reg.PPRank}
	s.mu.Lock()
	info, ok := s.ranks[key]
	ok = ok && info == RankInfo{RankIP: reg.RankIP, RankPort: reg.RankPort}
	if ok {
		delete(s.ranks, key)
	}
	left := len(s.ranks)
	s.mu.Unlock()
	if ok {
		s.log.Info("prefill rank deregistered", "dp", key.dp, "cp", key.cp, "tp", key.tp, "pp", key.pp,
			"rank_ip", reg.RankIP, "rank_port", reg.RankPort, "registered", left)
	}
	return ok
}

// lost says why /health fails: ranks of a deployment that was whole
// deregistered ("" while none is missing).
func (s *Server) lost() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.complete || len(s.ranks) >= s.layout.expected() {
		return ""
	}
	return fmt.Sprintf("Prefill ranks lost: %d of %d registered.", len(s.ranks), s.layout.expected())
}

func (s *Server) handleRoute(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	names := []string{"prefill_dp_rank", "prefill_cp_rank", "target_tp_rank", "target_pp_rank"}
	var v [4]int
	for i, n := range names {
		raw := q.Get(n)
		if raw == "" {
			text(w, http.StatusBadRequest, "Missing inputs for bootstrap server.")
			return
		}
		x, err := strconv.Atoi(raw)
		if err != nil {
			s.badRequest(w, r, fmt.Errorf("query parameter %s=%q is not an integer", n, truncate(raw)))
			return
		}
		v[i] = x
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.readyLocked() {
		text(w, http.StatusServiceUnavailable, fmt.Sprintf("Prefill server not fully registered yet (%d workers registered).", len(s.ranks)))
		return
	}
	if v == [4]int{-1, -1, -1, -1} {
		l := s.layout
		page := l.pageSize
		writeJSON(w, ParallelInfo{
			AttnTPSize: l.attnTP, AttnCPSize: l.attnCP, DPSize: l.dp, PPSize: l.pp,
			PageSize: &page, KVCacheDType: l.kvCacheDType,
			FollowBootstrapRoom: l.followBootstrapRoom, EnableDSACacheLayerSplit: l.dsaLayerSplit,
			PrefillHTTPPort: l.prefillHTTPPort,
		})
		return
	}
	info, ok := s.ranks[rankKey{dp: v[0], cp: v[1], tp: v[2], pp: v[3]}]
	if !ok {
		text(w, http.StatusNotFound, fmt.Sprintf("Bootstrap info not found for dp_rank=%d cp_rank=%d tp_rank=%d pp_rank=%d", v[0], v[1], v[2], v[3]))
		return
	}
	writeJSON(w, info)
}

func (s *Server) handleRegisterDPRank(w http.ResponseWriter, r *http.Request) {
	obj, err := readObject(w, r)
	if err != nil {
		s.badRequest(w, r, err)
		return
	}
	f := &fieldReader{obj: obj}
	room, _ := f.int64("bootstrap_room")
	dp, _ := f.int("dp_rank", true)
	if f.err != nil {
		s.badRequest(w, r, f.err)
		return
	}
	s.mu.Lock()
	s.purgeLocked()
	s.roomDP[room] = roomEntry{dp: dp, at: s.now()}
	s.mu.Unlock()
	text(w, http.StatusOK, "OK")
}

func (s *Server) handleQueryDPRanks(w http.ResponseWriter, r *http.Request) {
	obj, err := readObject(w, r)
	if err != nil {
		s.badRequest(w, r, err)
		return
	}
	raw, ok := obj["bootstrap_rooms"]
	var rooms []pyInt64
	if !ok {
		s.badRequest(w, r, errors.New(`missing field "bootstrap_rooms"`))
		return
	}
	if err := json.Unmarshal(raw, &rooms); err != nil {
		s.badRequest(w, r, fmt.Errorf(`field "bootstrap_rooms": want a list of integers: %w`, err))
		return
	}
	out := make(map[string]int)
	s.mu.Lock()
	s.purgeLocked()
	for _, room := range rooms {
		if e, ok := s.roomDP[uint64(room)]; ok {
			out[strconv.FormatUint(uint64(room), 10)] = e.dp
		}
	}
	s.mu.Unlock()
	writeJSON(w, out)
}

// purgeLocked drops expired room entries, at most once per TTL.
func (s *Server) purgeLocked() {
	now := s.now()
	if now.Sub(s.lastPurge) < s.ttl {
		return
	}
	s.lastPurge = now
	for room, e := range s.roomDP {
		if now.Sub(e.at) > s.ttl {
			delete(s.roomDP, room)
		}
	}
}

func (s *Server) badRequest(w http.ResponseWriter, r *http.Request, err error) {
	s.log.Warn("bad bootstrap request", "method", r.Method, "path", r.URL.Path, "remote", r.RemoteAddr, "err", err)
	text(w, http.StatusBadRequest, "Bad request: "+err.Error())
}

// pyInt64 is a room id: an integral JSON number or decimal string, up to
// 2^64-1.
type pyInt64 uint64

func (p *pyInt64) UnmarshalJSON(b []byte) error {
	s := string(b)
	if uq, err := strconv.Unquote(s); err == nil {
		s = uq
	}
	v, err := strconv.ParseUint(s, 10, 64)
	if err != nil {
		return fmt.Errorf("%s is not a room id", truncate(s))
	}
	*p = pyInt64(v)
	return nil
}

func (f *fieldReader) int64(key string) (uint64, bool) {
	raw, ok := f.obj[key]
	if !ok {
		if f.err == nil {
			f.err = fmt.Errorf("missing field %q", key)
		}
		return 0, false
	}
	var v pyInt64
	if err := json.Unmarshal(raw, &v); err != nil {
		if f.err == nil {
			f.err = fmt.Errorf("field %q: %w", key, err)
		}
		return 0, false
	}
	return uint64(v), true
}

// Running is a Server listening on a TCP address.
type Running struct {
	hs    *http.Server
	ln    net.Listener
	log   *slog.Logger
	rlog  *ratelog.Logger // the server's, flushed by Close
	grace time.Duration   // see httpLimits.closeGrace
	done  chan error      // Serve's result

	mu      sync.Mutex
	conns   map[net.Conn]http.ConnState // open connections and their states
	closing bool                        // Close has begun
	drained chan struct{}               // closed when closing and conns is empty

	closeOnce sync.Once
	closeErr  error
}

// Start listens on addr ("host:port"; port 0 picks one) and serves s in
// the background until Close. A client must send its headers within 10 s
// and its whole request within 30 s, read its response within 30 s, and
// may keep an idle connection for 2 minutes; headers are capped at 64 KiB
// and bodies at 1 MiB.
func (s *Server) Start(addr string) (*Running, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("bootstrap: listen on %s: %w", addr, err)
	}
	rs := &Running{
		ln:      ln,
		log:     s.log,
		rlog:    s.rlog,
		grace:   s.limits.closeGrace,
		done:    make(chan error, 1),
		conns:   make(map[net.Conn]http.ConnState),
		drained: make(chan struct{}),
	}
	rs.hs = &http.Server{
		Handler:           s,
		ReadHeaderTimeout: s.limits.readHeader,
		ReadTimeout:       s.limits.read,
		WriteTimeout:      s.limits.write,
		IdleTimeout:       s.limits.idle,
		MaxHeaderBytes:    s.limits.maxHeaderBytes,
		ErrorLog:          slog.NewLogLogger(s.log.Handler(), slog.LevelWarn),
		ConnState:         rs.connState,
	}
	go func() { rs.done <- rs.hs.Serve(ln) }()
	s.log.Info("bootstrap server listening", "addr", ln.Addr().String())
	return rs, nil
}

// connState tracks every connection (http.Server's ConnState hook). Once
// Close has begun, a connection that is new or idle (between requests)
// is closed at once: it has no request in flight. http.Server.Shutdown
// alone would wait for a new connection until it is 5 s old, and a
// client's dial race routinely leaves one that is never used.
func (rs *Running) connState(c net.Conn, st http.ConnState) {
	rs.mu.Lock()
	defer rs.mu.Unlock()
	switch st {
	case http.StateClosed, http.StateHijacked:
		delete(rs.conns, c)
		if rs.closing && len(rs.conns) == 0 {
			rs.closeDrained()
		}
		return
	case http.StateNew, http.StateIdle:
		if rs.closing {
			c.Close()
		}
	}
	rs.conns[c] = st
}

func (rs *Running) closeDrained() {
	select {
	case <-rs.drained:
	default:
		close(rs.drained)
	}
}

// Addr is the host:port clients use (SGLang's bootstrap_addr).
func (rs *Running) Addr() string { return rs.ln.Addr().String() }

// Close stops listening and closes every connection. Connections with no
// request in flight (idle keep-alive ones, ones never used) are closed at
// once; requests in flight get a short grace (250 ms, less if ctx ends
// sooner) to finish, and whatever is still in flight after it (stalled
// clients) is dropped. Close returns once every connection's goroutine
// has ended, so it takes at most about the grace, whatever the clients
// do. It returns ctx's error if ctx ended before that. Calling it again
// returns the first result.
func (rs *Running) Close(ctx context.Context) error {
	rs.closeOnce.Do(func() {
		rs.mu.Lock()
		rs.closing = true
		for c, st := range rs.conns {
			if st == http.StateNew || st == http.StateIdle {
				c.Close()
			}
		}
		if len(rs.conns) == 0 {
			rs.closeDrained()
		}
		rs.mu.Unlock()

		gctx, cancel := context.WithTimeout(ctx, rs.grace)
		err := rs.hs.Shutdown(gctx)
		cancel()
		if err != nil {
			// Stalled clients: drop them.
			rs.mu.Lock()
			n := len(rs.conns)
			rs.mu.Unlock()
			rs.log.Info("bootstrap server closing: dropping requests still in flight", "connections", n, "grace", rs.grace)
			rs.hs.Close()
		}
		if serr := <-rs.done; serr != nil && !errors.Is(serr, http.ErrServerClosed) {
			rs.closeErr = serr
		}
		// Every connection is closed now; wait for their goroutines
		// (handlers see their reads and writes fail at once).
		select {
		case <-rs.drained:
		case <-ctx.Done():
		case <-time.After(time.Second):
			rs.log.Warn("bootstrap server closing: connections did not end within 1 s")
		}
		if rs.closeErr == nil {
			rs.closeErr = ctx.Err()
		}
		rs.rlog.Close() // report what was suppressed
	})
	return rs.closeErr
}
