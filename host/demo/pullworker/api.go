package pullworker

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync/atomic"
	"time"

	"github.com/kvhost/kvhost/host/internal/backoff"
	"github.com/kvhost/kvhost/host/pull"
)

// The prefill worker's HTTP API, standing in for vLLM's OpenAI server as a
// proxy uses it: the proxy asks for a prefill with
// kv_transfer_params {"do_remote_decode": true} and forwards the
// kv_transfer_params of the answer to the decode.
const (
	// PrefillPath takes a PrefillRequest (POST) and answers a
	// PrefillResponse.
	PrefillPath = "/kvhost/v1/prefill"
	// HealthPath answers 200 "OK" once the worker serves.
	HealthPath = "/health"
	// SummaryPath answers the worker's summary so far (GET).
	SummaryPath = "/kvhost/v1/summary"
)

// PrefillRequest asks the prefill worker to prefill a request.
type PrefillRequest struct {
	RequestID        string                `json:"request_id"`
	NumTokens        int                   `json:"num_tokens"`
	KVTransferParams pull.KVTransferParams `json:"kv_transfer_params"`
}

// PrefillResponse carries the kv_transfer_params the decode pulls with.
type PrefillResponse struct {
	RequestID        string                `json:"request_id"`
	KVTransferParams pull.KVTransferParams `json:"kv_transfer_params"`
}

// apiError is the body of every non-200 answer.
type apiError struct {
	Error string `json:"error"`
}

// prefillClient calls a prefill worker's API.
type prefillClient struct {
	base string
	http *http.Client
	// down is set once a call could not reach the worker for
	// unreachableBudget: later calls then try once instead of waiting
	// again, so a dead prefill fails the remaining requests at once. A
	// successful call clears it.
	down atomic.Bool
	// budget is how long one call keeps retrying a worker it cannot
	// connect to (at most unreachableBudget).
	budget time.Duration
}

// unreachableBudget is how long one call keeps retrying a prefill worker
// it cannot connect to (after waitHealthy saw it up).
const unreachableBudget = 5 * time.Second

func newPrefillClient(base string, budget time.Duration) *prefillClient {
	if budget <= 0 || budget > unreachableBudget {
		budget = unreachableBudget
	}
	return &prefillClient{base: strings.TrimRight(base, "/"), http: &http.Client{Timeout: 60 * time.Second}, budget: budget}
}

// errRetry marks answers worth retrying (the worker is not up yet, or out
// of blocks for now); errUnreachable, among them, failed to connect.
var (
	errRetry       = errors.New("retry")
	errUnreachable = errors.New("unreachable")
)

// waitHealthy polls the health endpoint until it answers or ctx ends.
func (c *prefillClient) waitHealthy(ctx context.Context) error {
	var last error
	for retry := backoff.New(20*time.Millisecond, 500*time.Millisecond); ; {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, c.base+HealthPath, nil)
		if err != nil {
			return err
		}
		resp, err := c.http.Do(req)
		if err == nil {
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
			err = fmt.Errorf("health: %s", resp.Status)
		}
		last = err
		select {
		case <-ctx.Done():
			return fmt.Errorf("prefill worker at %s not healthy: %w (last: %v)", c.base, ctx.Err(), last)
		case <-time.After(retry.Next()):
		}
	}
}

// prefill asks for one request's prefill, retrying while the worker says
// to, until ctx ends.
func (c *prefillClient) prefill(ctx context.Context, id string, tokens int) (pull.KVTransferParams, error) {
	body, err := json.Marshal(PrefillRequest{RequestID: id, NumTokens: tokens,
		KVTransferParams: pull.KVTransferParams{DoRemoteDecode: true}})
	if err != nil {
		return pull.KVTransferParams{}, err
	}
	var unreachable time.Time // first connection failure of this call
	for retry := backoff.New(5*time.Millisecond, 200*time.Millisecond); ; {
		p, err := c.prefillOnce(ctx, body)
		if err == nil {
			c.down.Store(false)
			return p, nil
		}
		if ctx.Err() != nil {
			if !unreachable.IsZero() {
				c.down.Store(true)
			}
			return pull.KVTransferParams{}, fmt.Errorf("prefill %s: no answer from the prefill worker in time: %w", id, err)
		}
		if !errors.Is(err, errRetry) {
			return p, err
		}
		if errors.Is(err, errUnreachable) {
			if unreachable.IsZero() {
				unreachable = time.Now()
			}
			if c.down.Load() || time.Since(unreachable) > c.budget {
				c.down.Store(true)
				return pull.KVTransferParams{}, fmt.Errorf("prefill %s: worker unreachable: %w", id, err)
			}
		}
		select {
		case <-ctx.Done():
			if !unreachable.IsZero() {
				c.down.Store(true)
			}
			return pull.KVTransferParams{}, fmt.Errorf("prefill %s: no answer from the prefill worker in time: %w (last: %v)", id, ctx.Err(), err)
		case <-time.After(retry.Next()):
		}
	}
}

func (c *prefillClient) prefillOnce(ctx context.Context, body []byte) (pull.KVTransferParams, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, c.base+PrefillPath, bytes.NewReader(body))
	if err != nil {
		return pull.KVTransferParams{}, err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := c.http.Do(req)
	if err != nil {
		if ctx.Err() != nil {
			return pull.KVTransferParams{}, err
		}
		return pull.KVTransferParams{}, fmt.Errorf("%w: %w: %w", errRetry, errUnreachable, err)
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(io.LimitReader(resp.Body, 16<<20))
	if err != nil {
		return pull.KVTransferParams{}, fmt.Errorf("prefill answer: %w", err)
	}
	if resp.StatusCode != http.StatusOK {
		var e apiError
		_ = json.Unmarshal(data, &e)
		err := fmt.Errorf("prefill worker: %s: %s", resp.Status, e.Error)
		if resp.StatusCode == http.StatusServiceUnavailable {
			err = fmt.Errorf("%w: %w", errRetry, err)
		}
		return pull.KVTransferParams{}, err
	}
	var out PrefillResponse
	if err := json.Unmarshal(data, &out); err != nil {
		return pull.KVTransferParams{}, fmt.Errorf("prefill answer: %w", err)
	}
	return out.KVTransferParams, nil
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}

func writeError(w http.ResponseWriter, status int, format string, args ...any) {
	writeJSON(w, status, apiError{Error: fmt.Sprintf(format, args...)})
}
