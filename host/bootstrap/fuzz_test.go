package bootstrap

import (
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"testing"
)

// FuzzHandlers sends arbitrary bodies and queries to every route: the
// server must answer (never panic) with one of the documented codes.
func FuzzHandlers(f *testing.F) {
	good, _ := json.Marshal(reg(1, 0, 1, 0))
	f.Add(string(good), "prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1")
	f.Add(`{"bootstrap_room": 5, "dp_rank": 1}`, "prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=0&target_pp_rank=0")
	f.Add(`{"bootstrap_rooms": [1, "2", 3.0]}`, "prefill_dp_rank=x")
	f.Add(`{"attn_tp_size": "1e400"}`, "%zz")
	f.Fuzz(func(t *testing.T, body, query string) {
		s := NewServer(WithLogger(quiet))
		// Register a valid single-rank deployment first half the time, so
		// GET paths past the readiness check are reached too.
		if len(body)%2 == 0 {
			s.ServeHTTP(httptest.NewRecorder(), httptest.NewRequest("PUT", "/route", strings.NewReader(string(good))))
		}
		for _, r := range []struct{ method, path string }{
			{"PUT", "/route"}, {"GET", "/route"}, {"POST", "/register_dp_rank"}, {"POST", "/query_dp_ranks"},
		} {
			req := httptest.NewRequest(r.method, "/x", strings.NewReader(body))
			req.URL = &url.URL{Path: r.path, RawQuery: query}
			w := httptest.NewRecorder()
			s.ServeHTTP(w, req)
			switch w.Code {
			case http.StatusOK, http.StatusBadRequest, http.StatusConflict, http.StatusNotFound, http.StatusServiceUnavailable:
			default:
				t.Fatalf("%s %s?%s body %q: code %d %q", r.method, r.path, query, body, w.Code, w.Body.String())
			}
			if w.Code == http.StatusOK && w.Header().Get("Content-Type") == "application/json; charset=utf-8" && !json.Valid(w.Body.Bytes()) {
				t.Fatalf("invalid JSON answer %q", w.Body.String())
			}
		}
	})
}

// FuzzClientResponses feeds arbitrary server answers to the client's
// decoders: errors are fine, panics and nonsense results are not.
func FuzzClientResponses(f *testing.F) {
	f.Add([]byte(`{"rank_ip": "10.0.0.1", "rank_port": 17000}`))
	f.Add([]byte(`{"attn_tp_size": 2, "attn_cp_size": 1, "dp_size": 1, "pp_size": 1, "page_size": 16}`))
	f.Add([]byte(`{"12345": 0}`))
	f.Fuzz(func(t *testing.T, body []byte) {
		if ri, err := parseRankInfo(body); err == nil && (ri.RankIP == "" || ri.RankPort < 1 || ri.RankPort > 65535) {
			t.Fatalf("accepted %+v", ri)
		}
		if pi, err := parseParallelInfo(body); err == nil && (pi.AttnTPSize < 1 || pi.PPSize < 1) {
			t.Fatalf("accepted %+v", pi)
		}
		parseDPRanks(body)
	})
}
