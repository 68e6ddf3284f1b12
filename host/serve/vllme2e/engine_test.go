package vllme2e

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"syscall"
	"time"

	"github.com/kvhost/kvhost/host/demo/kvpool"
	"github.com/kvhost/kvhost/host/internal/msgpack"
	"github.com/kvhost/kvhost/host/serve/client"
)

// The test engine: this test binary run again with engineEnv set is a
// vLLM engine process. It keeps each of its TP ranks' KV cache in POSIX
// shared memory, connects one control connection per rank to a sidecar
// (as vLLM's one worker process per rank would), registers the memory and
// opens the ranks, then obeys commands, one JSON line each on stdin, and
// answers one JSON line each on stdout.

// engineEnv holds the engine's config (engineConfig as JSON).
const engineEnv = "KVHOST_VLLME2E_ENGINE"

// engineConfig is what the test tells an engine process.
type engineConfig struct {
	Endpoint  string            `json:"endpoint"`
	Role      string            `json:"role"`
	EngineID  string            `json:"engine_id"`
	TPSize    int               `json:"tp_size"`
	Ranks     []int             `json:"ranks"`
	Blocks    int               `json:"blocks"`
	BlockSize int               `json:"block_size"`
	Layers    int               `json:"layers"`
	Heads     int               `json:"heads"`
	HeadBytes int               `json:"head_bytes"`
	AbortMs   int               `json:"abort_ms"`
	Compat    client.VLLMCompat `json:"compat"`
}

func (c engineConfig) geometry(rank int) kvpool.Geometry {
	return kvpool.Geometry{Attention: kvpool.MHA, Order: kvpool.Interleaved, HeadMajor: true, Layers: c.Layers,
		Pages: c.Blocks, PageSize: c.BlockSize, TotalHeads: c.Heads, TPSize: c.TPSize, TPRank: rank, HeadBytes: c.HeadBytes}
}

// command is one line of the engine's stdin.
type command struct {
	Op        string         `json:"op"` // fill, read, exit
	RequestID string         `json:"request_id,omitempty"`
	Params    map[string]any `json:"params,omitempty"`
	Blocks    []int32        `json:"blocks,omitempty"`
	Seed      uint64         `json:"seed,omitempty"`
	Tokens    int            `json:"tokens,omitempty"`
}

// answer is one line of the engine's stdout.
type answer struct {
	Ready    bool     `json:"ready,omitempty"`
	Endpoint string   `json:"endpoint,omitempty"`
	Err      string   `json:"err,omitempty"`
	OK       bool     `json:"ok"`
	Reasons  []string `json:"reasons,omitempty"`
	// Invalid are the invalid blocks of each rank's read event.
	Invalid [][]int32 `json:"invalid,omitempty"`
	Bytes   uint64    `json:"bytes,omitempty"`
	// Verified: every byte of the read's tokens checked on every rank.
	Verified bool `json:"verified,omitempty"`
}

type engineRank struct {
	c    *client.Client
	pool *kvpool.Pool
	shm  string
	id   uint64
}

// runEngine is the engine process's main.
func runEngine() int {
	var cfg engineConfig
	out := json.NewEncoder(os.Stdout)
	if err := json.Unmarshal([]byte(os.Getenv(engineEnv)), &cfg); err != nil {
		out.Encode(answer{Err: err.Error()})
		return 2
	}
	ranks, endpoint, err := openEngine(cfg)
	defer func() {
		for _, r := range ranks {
			r.c.Close()
			r.pool.Close()
			os.Remove(r.shm)
		}
	}()
	if err != nil {
		out.Encode(answer{Err: err.Error()})
		return 1
	}
	out.Encode(answer{Ready: true, OK: true, Endpoint: endpoint})
	in := bufio.NewScanner(os.Stdin)
	in.Buffer(nil, 16<<20)
	for in.Scan() {
		var cmd command
		if err := json.Unmarshal(in.Bytes(), &cmd); err != nil {
			out.Encode(answer{Err: err.Error()})
			continue
		}
		switch cmd.Op {
		case "fill":
			a := answer{OK: true}
			for _, r := range ranks {
				if err := r.pool.Fill(kvpool.Tokens{Request: cmd.Seed, Pages: cmd.Blocks, Count: cmd.Tokens}); err != nil {
					a = answer{Err: err.Error()}
				}
			}
			out.Encode(a)
		case "read":
			out.Encode(engineRead(ranks, cmd))
		case "exit":
			return 0
		default:
			out.Encode(answer{Err: "unknown op " + cmd.Op})
		}
	}
	return 0
}

func openEngine(cfg engineConfig) (ranks []*engineRank, endpoint string, err error) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for _, rank := range cfg.Ranks {
		g := cfg.geometry(rank)
		shm := filepath.Join("/dev/shm", fmt.Sprintf("kvhost-vllme2e-%d-%s-%d", os.Getpid(), cfg.Role, rank))
		pool, err := shmPool(shm, g)
		if err != nil {
			return ranks, "", err
		}
		c, err := client.Dial(ctx, cfg.Endpoint, client.Options{Name: "vllme2e-" + cfg.Role})
		if err != nil {
			pool.Close()
			os.Remove(shm)
			return ranks, "", err
		}
		r := &engineRank{c: c, pool: pool, shm: shm}
		ranks = append(ranks, r)
		regs := pool.Regions()
		if _, err := c.RegisterMemory(ctx, []client.Region{{Kind: "dram", Addr: regs[0].Addr, Length: g.Size(), SHM: shm}}); err != nil {
			return ranks, "", err
		}
		spec := client.VLLMRank{Role: cfg.Role, EngineID: cfg.EngineID, TPSize: cfg.TPSize, TPRank: rank,
			RegionLen: regs[0].Len, NumBlocks: cfg.Blocks, BlockSize: cfg.BlockSize, KVCacheLayout: "HND",
			TotalKVHeads: cfg.Heads, Compat: cfg.Compat, SideChannelHost: "127.0.0.1",
			AbortTimeout: time.Duration(cfg.AbortMs) * time.Millisecond}
		for _, x := range regs {
			spec.KVCachesBaseAddr = append(spec.KVCachesBaseAddr, x.Addr)
		}
		rk, err := c.OpenVLLM(ctx, spec)
		if err != nil {
			return ranks, "", fmt.Errorf("open_rank %d: %w", rank, err)
		}
		r.id = rk.ID
		if rk.Endpoint != "" {
			endpoint = rk.Endpoint
		}
	}
	return ranks, endpoint, nil
}

// shmPool makes a pool in a new POSIX shared-memory object.
func shmPool(path string, g kvpool.Geometry) (*kvpool.Pool, error) {
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	if err := f.Truncate(int64(g.Size())); err != nil {
		os.Remove(path)
		return nil, err
	}
	mem, err := syscall.Mmap(int(f.Fd()), 0, int(g.Size()), syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_SHARED)
	if err != nil {
		os.Remove(path)
		return nil, err
	}
	p, err := kvpool.Wrap(g, mem)
	if err != nil {
		syscall.Munmap(mem)
		os.Remove(path)
	}
	return p, err
}

// engineRead reads a request on every rank (start_load_kv), waits for
// every rank's read event (get_finished) and, when all are ok, checks
// every byte of the request's tokens in this process's memory.
func engineRead(ranks []*engineRank, cmd command) answer {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	params, err := jsonToMsgpack(cmd.Params)
	if err != nil {
		return answer{Err: err.Error()}
	}
	for _, r := range ranks {
		if err := r.c.Read(ctx, r.id, cmd.RequestID, params, cmd.Blocks); err != nil {
			return answer{Err: err.Error()}
		}
	}
	a := answer{OK: true}
	for _, r := range ranks {
		ev, err := waitRead(ctx, r.c, cmd.RequestID)
		if err != nil {
			return answer{Err: err.Error()}
		}
		a.OK = a.OK && ev.OK
		a.Reasons = append(a.Reasons, ev.Reason)
		a.Invalid = append(a.Invalid, ev.InvalidBlocks)
		a.Bytes += ev.Bytes
	}
	if a.OK && cmd.Tokens > 0 {
		for i, r := range ranks {
			if err := r.pool.Verify(kvpool.Tokens{Request: cmd.Seed, Pages: cmd.Blocks, Count: cmd.Tokens}); err != nil {
				a.Err = fmt.Sprintf("rank %d: %v", i, err)
				return a
			}
		}
		a.Verified = true
	}
	return a
}

func waitRead(ctx context.Context, c *client.Client, id string) (client.ReadEvent, error) {
	for {
		select {
		case e, ok := <-c.Events():
			if !ok {
				return client.ReadEvent{}, errors.New("connection closed")
			}
			if r, ok := e.AsRead(); ok && r.RequestID == id {
				return r, nil
			}
		case <-ctx.Done():
			return client.ReadEvent{}, fmt.Errorf("read %s: no read event: %w", id, ctx.Err())
		}
	}
}

// jsonToMsgpack turns kv_transfer_params as JSON (what a proxy passes on)
// into the msgpack map the engine sends.
func jsonToMsgpack(v any) (msgpack.Value, error) {
	var e msgpack.Encoder
	if err := encodeJSON(&e, v); err != nil {
		return msgpack.Value{}, err
	}
	return msgpack.Decode(e.Bytes())
}

func encodeJSON(e *msgpack.Encoder, v any) error {
	switch x := v.(type) {
	case nil:
		e.Nil()
	case bool:
		e.Bool(x)
	case float64:
		if x != float64(int64(x)) {
			e.Float(x)
		} else {
			e.Int(int64(x))
		}
	case string:
		e.Str(x)
	case []any:
		e.ArrayHeader(len(x))
		for _, it := range x {
			if err := encodeJSON(e, it); err != nil {
				return err
			}
		}
	case map[string]any:
		e.MapHeader(len(x))
		for k, it := range x {
			e.Str(k)
			if err := encodeJSON(e, it); err != nil {
				return err
			}
		}
	default:
		return fmt.Errorf("cannot encode %T", v)
	}
	return nil
}

// msgpackToJSON turns a decoded map (kv_transfer_params from hold) into
// plain JSON values.
func msgpackToJSON(v msgpack.Value) any {
	switch v.Kind {
	case msgpack.Bool:
		b, _ := v.Bool()
		return b
	case msgpack.Int, msgpack.Uint:
		n, _ := v.Int()
		return float64(n)
	case msgpack.Float:
		f, _ := v.Float()
		return f
	case msgpack.Str:
		s, _ := v.Str()
		return s
	case msgpack.Array:
		out := make([]any, len(v.Items))
		for i, it := range v.Items {
			out[i] = msgpackToJSON(it)
		}
		return out
	case msgpack.Map:
		out := map[string]any{}
		for _, p := range v.Pairs {
			k, _ := p[0].Str()
			out[k] = msgpackToJSON(p[1])
		}
		return out
	}
	return nil
}
