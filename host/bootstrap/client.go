package bootstrap

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"net/url"
	"strconv"
	"time"

	"github.com/kvhost/kvhost/host/internal/backoff"
)

// DefaultTimeout bounds one request whose context has no deadline (SGLang
// uses requests' timeout=5 for every bootstrap call).
const DefaultTimeout = 5 * time.Second

// StatusError is a response other than 200. Body is the server's text.
type StatusError struct {
	Op   string
	Code int
	Body string
}

func (e *StatusError) Error() string {
	return fmt.Sprintf("bootstrap: %s: HTTP %d: %s", e.Op, e.Code, e.Body)
}

// IsNotReady reports a 503: the prefill deployment has not finished
// registering (retry later).
func IsNotReady(err error) bool { return statusIs(err, http.StatusServiceUnavailable) }

// IsNotFound reports a 404: no prefill rank with those coordinates.
func IsNotFound(err error) bool { return statusIs(err, http.StatusNotFound) }

func statusIs(err error, code int) bool {
	var se *StatusError
	return errors.As(err, &se) && se.Code == code
}

// Client talks to a bootstrap server. Safe for concurrent use.
type Client struct {
	// Addr is the server's host:port (SGLang's bootstrap_addr).
	Addr string
	// HTTP is the client used; nil means http.DefaultClient.
	HTTP *http.Client
	// Timeout bounds each request when ctx has no deadline; 0 means
	// DefaultTimeout.
	Timeout time.Duration
	// RegisterAttempts and RegisterBackoff shape Register's retries
	// (SGLang: 5 attempts, delays 1 s, 2 s, 4 s, ... capped at 30 s, with
	// jitter). 0 means those defaults.
	RegisterAttempts int
	RegisterBackoff  time.Duration
}

// NewClient returns a client for the server at addr ("host:port").
func NewClient(addr string) *Client { return &Client{Addr: addr} }

func (c *Client) url(path string, q url.Values) string {
	u := url.URL{Scheme: "http", Host: c.Addr, Path: path}
	if q != nil {
		u.RawQuery = q.Encode()
	}
	return u.String()
}

// do sends one request and returns the body of a 200 response.
func (c *Client) do(ctx context.Context, op, method, path string, q url.Values, body any) ([]byte, error) {
	if _, ok := ctx.Deadline(); !ok {
		t := c.Timeout
		if t <= 0 {
			t = DefaultTimeout
		}
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, t)
		defer cancel()
	}
	var rd io.Reader
	if body != nil {
		b, err := json.Marshal(body)
		if err != nil {
			return nil, fmt.Errorf("bootstrap: %s: %w", op, err)
		}
		rd = bytes.NewReader(b)
	}
	req, err := http.NewRequestWithContext(ctx, method, c.url(path, q), rd)
	if err != nil {
		return nil, fmt.Errorf("bootstrap: %s: %w", op, err)
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	hc := c.HTTP
	if hc == nil {
		hc = http.DefaultClient
	}
	resp, err := hc.Do(req)
	if err != nil {
		return nil, fmt.Errorf("bootstrap: %s: %w", op, err)
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(io.LimitReader(resp.Body, maxBody))
	if err != nil {
		return nil, fmt.Errorf("bootstrap: %s: reading response: %w", op, err)
	}
	if resp.StatusCode != http.StatusOK {
		return nil, &StatusError{Op: op, Code: resp.StatusCode, Body: string(bytes.TrimSpace(data))}
	}
	return data, nil
}

// Register PUTs this prefill rank's registration, retrying failures like
// SGLang's register_to_bootstrap until it succeeds, the attempts run out
// or ctx ends. A 4xx answer is not retried: it will not change.
func (c *Client) Register(ctx context.Context, reg Registration) error {
	attempts := c.RegisterAttempts
	if attempts <= 0 {
		attempts = 5
	}
	first := c.RegisterBackoff
	if first <= 0 {
		first = time.Second
	}
	retry := backoff.New(min(first, 30*time.Second), 30*time.Second)
	var err error
	for i := range attempts {
		if _, err = c.do(ctx, "register", http.MethodPut, "/route", nil, reg); err == nil {
			return nil
		}
		var se *StatusError
		if errors.As(err, &se) && se.Code >= 400 && se.Code < 500 {
			return err
		}
		if i == attempts-1 {
			break
		}
		delay := time.Duration(float64(retry.Next()) * (0.75 + 0.25*rand.Float64()))
		select {
		case <-time.After(delay):
		case <-ctx.Done():
			return fmt.Errorf("bootstrap: register: %w (last error: %v)", ctx.Err(), err)
		}
	}
	return fmt.Errorf("bootstrap: register failed after %d attempts: %w", attempts, err)
}

// Route asks where the prefill rank (dp, cp, tp, pp) listens.
func (c *Client) Route(ctx context.Context, dpRank, cpRank, tpRank, ppRank int) (RankInfo, error) {
	body, err := c.do(ctx, "route", http.MethodGet, "/route", routeQuery(dpRank, cpRank, tpRank, ppRank), nil)
	if err != nil {
		return RankInfo{}, err
	}
	return parseRankInfo(body)
}

func parseRankInfo(body []byte) (RankInfo, error) {
	var raw struct {
		RankIP   string `json:"rank_ip"`
		RankPort pyInt  `json:"rank_port"`
	}
	if err := json.Unmarshal(body, &raw); err != nil {
		return RankInfo{}, fmt.Errorf("bootstrap: route: bad response %q: %w", truncate(string(body)), err)
	}
	if raw.RankIP == "" || !raw.RankPort.set || raw.RankPort.v < 1 || raw.RankPort.v > 65535 {
		return RankInfo{}, fmt.Errorf("bootstrap: route: incomplete response %q", truncate(string(body)))
	}
	return RankInfo{RankIP: raw.RankIP, RankPort: int(raw.RankPort.v)}, nil
}

// ParallelInfo asks for the prefill deployment's layout (the all -1
// query). Before every rank registered it fails with an error for which
// IsNotReady is true.
func (c *Client) ParallelInfo(ctx context.Context) (ParallelInfo, error) {
	body, err := c.do(ctx, "parallel info", http.MethodGet, "/route", routeQuery(-1, -1, -1, -1), nil)
	if err != nil {
		return ParallelInfo{}, err
	}
	return parseParallelInfo(body)
}

func parseParallelInfo(body []byte) (ParallelInfo, error) {
	var info ParallelInfo
	if err := json.Unmarshal(body, &info); err != nil {
		return info, fmt.Errorf("bootstrap: parallel info: bad response %q: %w", truncate(string(body)), err)
	}
	if info.AttnTPSize < 1 || info.AttnCPSize < 1 || info.DPSize < 1 || info.PPSize < 1 {
		return info, fmt.Errorf("bootstrap: parallel info: sizes must be positive: %q", truncate(string(body)))
	}
	return info, nil
}

func routeQuery(dp, cp, tp, pp int) url.Values {
	return url.Values{
		"prefill_dp_rank": {strconv.Itoa(dp)},
		"prefill_cp_rank": {strconv.Itoa(cp)},
		"target_tp_rank":  {strconv.Itoa(tp)},
		"target_pp_rank":  {strconv.Itoa(pp)},
	}
}

// Health is the decode heartbeat: GET /health must answer 200.
func (c *Client) Health(ctx context.Context) error {
	_, err := c.do(ctx, "health", http.MethodGet, "/health", nil, nil)
	return err
}

// RegisterDPRank records which prefill DP rank serves a room (prefill
// side, when rooms do not map to DP ranks by modulo).
func (c *Client) RegisterDPRank(ctx context.Context, room uint64, dpRank int) error {
	_, err := c.do(ctx, "register dp rank", http.MethodPost, "/register_dp_rank", nil,
		map[string]any{"bootstrap_room": room, "dp_rank": dpRank})
	return err
}

// QueryDPRanks asks which prefill DP rank serves each room; rooms the
// server does not know are absent from the result.
func (c *Client) QueryDPRanks(ctx context.Context, rooms []uint64) (map[uint64]int, error) {
	if rooms == nil {
		rooms = []uint64{}
	}
	body, err := c.do(ctx, "query dp ranks", http.MethodPost, "/query_dp_ranks", nil, map[string]any{"bootstrap_rooms": rooms})
	if err != nil {
		return nil, err
	}
	return parseDPRanks(body)
}

func parseDPRanks(body []byte) (map[uint64]int, error) {
	var raw map[string]int
	if err := json.Unmarshal(body, &raw); err != nil {
		return nil, fmt.Errorf("bootstrap: query dp ranks: bad response %q: %w", truncate(string(body)), err)
	}
	out := make(map[uint64]int, len(raw))
	for k, v := range raw {
		room, err := strconv.ParseUint(k, 10, 64)
		if err != nil {
			return nil, fmt.Errorf("bootstrap: query dp ranks: bad room key %q", truncate(k))
		}
		out[room] = v
	}
	return out, nil
}
