package bootstrap

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"reflect"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvhost/kvhost/host/internal/zmq/zmqtest"
)

var quiet = slog.New(slog.DiscardHandler)

func start(t *testing.T, opts ...ServerOption) (*Server, *Client) {
	t.Helper()
	s := NewServer(append([]ServerOption{WithLogger(quiet)}, opts...)...)
	rs, err := s.Start("127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { rs.Close(context.Background()) })
	return s, NewClient(rs.Addr())
}

func reg(tp, tpRank, pp, ppRank int) Registration {
	http := 8000
	return Registration{
		AttnTPSize: tp, AttnTPRank: tpRank, AttnCPSize: 1, AttnCPRank: 0, AttnDPSize: 1, AttnDPRank: 0,
		PPSize: pp, PPRank: ppRank, SystemDPSize: 1, SystemDPRank: 0,
		RankIP: "10.0.0.1", RankPort: 17000 + 10*tpRank + ppRank, PageSize: 16, KVCacheDType: "auto",
		LoadBalanceMethod: "follow_bootstrap_room", PrefillHTTPPort: &http,
	}
}

func TestRegistrationAndQueries(t *testing.T) {
	s, c := start(t)
	ctx := context.Background()
	if err := c.Health(ctx); err != nil {
		t.Fatalf("health: %v", err)
	}
	if _, err := c.ParallelInfo(ctx); !IsNotReady(err) {
		t.Fatalf("parallel info before registration: %v", err)
	}
	// TP 2 x PP 2 = 4 ranks. Register three, one of them twice: still not
	// ready (SGLang would count 4 PUTs and say ready).
	for _, r := range []Registration{reg(2, 0, 2, 0), reg(2, 1, 2, 0), reg(2, 0, 2, 1), reg(2, 0, 2, 1)} {
		if err := c.Register(ctx, r); err != nil {
			t.Fatal(err)
		}
	}
	if s.Ready() {
		t.Fatal("ready with 3 of 4 ranks")
	}
	if _, err := c.Route(ctx, 0, 0, 0, 0); !IsNotReady(err) || !strings.Contains(err.Error(), "3 workers registered") {
		t.Fatalf("route before ready: %v", err)
	}
	if err := c.Register(ctx, reg(2, 1, 2, 1)); err != nil {
		t.Fatal(err)
	}
	if !s.Ready() {
		t.Fatal("not ready with all ranks")
	}
	info, err := c.ParallelInfo(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if info.AttnTPSize != 2 || info.PPSize != 2 || info.DPSize != 1 || info.AttnCPSize != 1 || *info.PageSize != 16 ||
		*info.KVCacheDType != "auto" || !info.FollowBootstrapRoom || *info.PrefillHTTPPort != 8000 || info.TargetTPRanks != nil {
		t.Fatalf("parallel info %+v", info)
	}
	got, err := c.Route(ctx, 0, 0, 1, 1)
	if err != nil || got != (RankInfo{"10.0.0.1", 17011}) {
		t.Fatalf("route: %+v %v", got, err)
	}
	if _, err := c.Route(ctx, 0, 0, 2, 0); !IsNotFound(err) {
		t.Fatalf("unknown rank: %v", err)
	}
	// A rank re-registering at a new address is served at the new one.
	moved := reg(2, 1, 2, 1)
	moved.RankPort = 18000
	if err := c.Register(ctx, moved); err != nil {
		t.Fatal(err)
	}
	if got, _ := c.Route(ctx, 0, 0, 1, 1); got.RankPort != 18000 {
		t.Fatalf("after move: %+v", got)
	}
}

// The all -1 answer has exactly PrefillServerInfo's fields, because
// SGLang's decode rebuilds the dataclass from it.
func TestParallelInfoFieldSet(t *testing.T) {
	_, c := start(t)
	r := reg(1, 0, 1, 0)
	r.PrefillHTTPPort = nil
	if err := c.Register(context.Background(), r); err != nil {
		t.Fatal(err)
	}
	resp, err := http.Get("http://" + c.Addr + "/route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var m map[string]any
	if err := json.NewDecoder(resp.Body).Decode(&m); err != nil {
		t.Fatal(err)
	}
	var keys []string
	for k := range m {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	want := []string{"attn_cp_size", "attn_tp_size", "dp_size", "enable_dsa_cache_layer_split", "follow_bootstrap_room",
		"kv_cache_dtype", "page_size", "pp_size", "prefill_http_port", "required_dst_info_num",
		"required_prefill_response_num", "target_cp_ranks", "target_pp_ranks", "target_tp_rank", "target_tp_ranks"}
	if !reflect.DeepEqual(keys, want) {
		t.Fatalf("keys %v\nwant %v", keys, want)
	}
	if m["prefill_http_port"] != nil || m["target_tp_ranks"] != nil {
		t.Fatalf("nulls expected: %v", m)
	}
}

// rawConn dials the server at addr and writes first (nothing, or a part of
// a request) with a deadline on the connection, which the test's cleanup
// closes.
func rawConn(t *testing.T, addr, first string, deadline time.Duration) net.Conn {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	c.SetDeadline(time.Now().Add(deadline))
	io.WriteString(c, first)
	return c
}

func rawDo(t *testing.T, method, url, body string) (int, string) {
	t.Helper()
	req, _ := http.NewRequest(method, url, strings.NewReader(body))
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

func TestBadRequests(t *testing.T) {
	_, c := start(t)
	base := "http://" + c.Addr
	good, _ := json.Marshal(reg(2, 0, 1, 0))
	var obj map[string]any
	json.Unmarshal(good, &obj)
	mutate := func(k string, v any) string {
		m := map[string]any{}
		for kk, vv := range obj {
			m[kk] = vv
		}
		if v == nil {
			delete(m, k)
		} else {
			m[k] = v
		}
		b, _ := json.Marshal(m)
		return string(b)
	}
	cases := []struct {
		method, path, body string
		code               int
		says               string
	}{
		{"PUT", "/route", "{not json", 400, "not a JSON object"},
		{"PUT", "/route", "[1,2]", 400, "not a JSON object"},
		{"PUT", "/route", "null", 400, "not a JSON object"},
		{"PUT", "/route", mutate("attn_tp_size", nil), 400, `missing field "attn_tp_size"`},
		{"PUT", "/route", mutate("rank_port", "http"), 400, `field "rank_port"`},
		{"PUT", "/route", mutate("rank_ip", ""), 400, "rank_ip"},
		{"PUT", "/route", mutate("attn_tp_rank", 2), 400, "attn_tp rank 2 outside size 2"},
		{"PUT", "/route", mutate("page_size", 1.5), 400, "page_size"},
		{"DELETE", "/route", "", 405, "Method not allowed"},
		{"GET", "/route?prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=0", "", 400, "Missing inputs for bootstrap server."},
		{"GET", "/route?prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=x&target_pp_rank=0", "", 400, "not an integer"},
		{"POST", "/register_dp_rank", `{"dp_rank": 0}`, 400, "bootstrap_room"},
		{"POST", "/query_dp_ranks", `{"bootstrap_rooms": "x"}`, 400, "list of integers"},
		{"GET", "/nope", "", 404, "Not Found"},
		{"POST", "/health", "", 405, "Method not allowed"},
	}
	for _, tc := range cases {
		code, body := rawDo(t, tc.method, base+tc.path, tc.body)
		if code != tc.code || !strings.Contains(body, tc.says) {
			t.Errorf("%s %s %q: %d %q, want %d mentioning %q", tc.method, tc.path, truncate(tc.body), code, body, tc.code, tc.says)
		}
	}
	// String-valued ports are accepted, as Python's int() accepts them.
	if code, body := rawDo(t, "PUT", base+"/route", mutate("rank_port", "17000")); code != 200 {
		t.Fatalf("string port: %d %s", code, body)
	}
	// A registration contradicting the layout is refused with 409.
	conflict := reg(4, 1, 1, 0)
	err := c.Register(context.Background(), conflict)
	var se *StatusError
	if !errors.As(err, &se) || se.Code != 409 || !strings.Contains(se.Body, "attn_tp_size 4, registered ranks have 2") {
		t.Fatalf("conflict: %v", err)
	}
	dt := reg(2, 1, 1, 0)
	dt.KVCacheDType = "fp8_e5m2"
	if err := c.Register(context.Background(), dt); !errors.As(err, &se) || se.Code != 409 || !strings.Contains(se.Body, "kv_cache_dtype") {
		t.Fatalf("dtype conflict: %v", err)
	}
}

// With system DP (no DP attention) the DP group is system_dp_rank.
func TestSystemDPGroups(t *testing.T) {
	s, c := start(t)
	ctx := context.Background()
	for dp := range 2 {
		r := reg(1, 0, 1, 0)
		r.SystemDPSize, r.SystemDPRank = 2, dp
		r.RankPort = 21000 + dp
		if err := c.Register(ctx, r); err != nil {
			t.Fatal(err)
		}
	}
	if !s.Ready() {
		t.Fatal("not ready")
	}
	info, _ := c.ParallelInfo(ctx)
	if info.DPSize != 2 {
		t.Fatalf("dp size %d", info.DPSize)
	}
	if got, err := c.Route(ctx, 1, 0, 0, 0); err != nil || got.RankPort != 21001 {
		t.Fatalf("dp 1: %+v %v", got, err)
	}
}

func TestDPRankEntriesExpire(t *testing.T) {
	var now atomic.Int64
	now.Store(time.Unix(1000, 0).UnixNano())
	_, c := start(t, WithEntryTTL(time.Minute), withClock(func() time.Time { return time.Unix(0, now.Load()) }))
	ctx := context.Background()
	if err := c.RegisterDPRank(ctx, 1<<63+5, 3); err != nil {
		t.Fatal(err)
	}
	got, err := c.QueryDPRanks(ctx, []uint64{1<<63 + 5, 7})
	if err != nil || !reflect.DeepEqual(got, map[uint64]int{1<<63 + 5: 3}) {
		t.Fatalf("query: %v %v", got, err)
	}
	now.Add(int64(2 * time.Minute))
	got, err = c.QueryDPRanks(ctx, []uint64{1<<63 + 5})
	if err != nil || len(got) != 0 {
		t.Fatalf("after expiry: %v %v", got, err)
	}
}

func TestClientTimeoutsAndRetries(t *testing.T) {
	release := make(chan struct{})
	hang := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { <-release }))
	defer hang.Close()
	defer close(release)
	c := &Client{Addr: strings.TrimPrefix(hang.URL, "http://"), Timeout: 100 * time.Millisecond}
	start := time.Now()
	if err := c.Health(context.Background()); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("hung server: %v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	if err := c.Health(ctx); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("ctx deadline: %v", err)
	}
	if el := time.Since(start); el > 2*time.Second {
		t.Fatalf("timeouts took %v", el)
	}

	var calls atomic.Int32
	flaky := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if calls.Add(1) < 3 {
			http.Error(w, "warming up", 500)
			return
		}
		w.Write([]byte("OK"))
	}))
	defer flaky.Close()
	c = &Client{Addr: strings.TrimPrefix(flaky.URL, "http://"), RegisterBackoff: time.Millisecond}
	if err := c.Register(context.Background(), reg(1, 0, 1, 0)); err != nil || calls.Load() != 3 {
		t.Fatalf("retry: %v after %d calls", err, calls.Load())
	}
	calls.Store(0)
	refuse := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		calls.Add(1)
		http.Error(w, "no", 400)
	}))
	defer refuse.Close()
	c = &Client{Addr: strings.TrimPrefix(refuse.URL, "http://"), RegisterBackoff: time.Millisecond}
	if err := c.Register(context.Background(), reg(1, 0, 1, 0)); err == nil || calls.Load() != 1 {
		t.Fatalf("4xx must not be retried: %v after %d calls", err, calls.Load())
	}
	c = &Client{Addr: "127.0.0.1:1", RegisterAttempts: 2, RegisterBackoff: time.Millisecond}
	if err := c.Register(context.Background(), reg(1, 0, 1, 0)); err == nil || !strings.Contains(err.Error(), "after 2 attempts") {
		t.Fatalf("unreachable: %v", err)
	}
}

// SGLang's own client logic (registration payload, PrefillServerInfo(**json),
// PrefillRankInfo(**json)) works against the Go server.
func TestInteropSGLangClient(t *testing.T) {
	zmqtest.RequirePython(t, "json")
	_, c := start(t)
	peer := zmqtest.Start(t, "testdata/sglang_bootstrap_client.py", "run", c.Addr, "2", "2")
	if l := peer.Line(20 * time.Second); l != "OK" {
		t.Fatalf("peer: %q", l)
	}
	peer.Wait(10 * time.Second)
}

func TestRunningClose(t *testing.T) {
	s := NewServer(WithLogger(quiet))
	rs, err := s.Start("127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	c := NewClient(rs.Addr())
	if err := c.Health(context.Background()); err != nil {
		t.Fatal(err)
	}
	if err := rs.Close(context.Background()); err != nil {
		t.Fatal(err)
	}
	if err := rs.Close(context.Background()); err != nil {
		t.Fatalf("second close: %v", err)
	}
	c.Timeout = 500 * time.Millisecond
	if err := c.Health(context.Background()); err == nil {
		t.Fatal("health after close succeeded")
	}
}
