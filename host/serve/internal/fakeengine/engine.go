// Package fakeengine is a stand-in for a serving engine's side of kvhost
// serve: it owns its KV cache in POSIX shared memory (laid out as
// host/demo/kvpool lays out a rank's pool), registers it with a sidecar
// through host/serve/client, and drives SGLang rooms as SGLang's
// KVSender and KVReceiver do (python/sglang/srt/disaggregation/prefill.py
// and decode.py), filling prefill pages with kvpool's byte formula and
// verifying every byte that lands in its own memory. The e2e tests use it
// in process and through the test engine program
// (host/serve/internal/testengine).
package fakeengine

import (
	"context"
	"encoding/binary"
	"fmt"
	"os"
	"strings"
	"sync"
	"syscall"

	"github.com/kvhost/kvhost/host/demo/kvpool"
	"github.com/kvhost/kvhost/host/serve/client"
)

// Shape is the model shape every rank shares.
type Shape struct {
	Layers    int
	KVHeads   int // KV heads of the model (MHA)
	HeadBytes int
	PageSize  int
	Pages     int // pages of each rank's pool
	AuxItems  int
	MLA       bool
}

// Rank is one engine rank: its pool in shared memory and the sidecar's
// rank over it.
type Rank struct {
	Role    string
	TP      int
	TPSize  int
	Pool    *kvpool.Pool
	SHM     string // register_memory's shm of the pool (a POSIX shared-memory name by NewRank)
	mem     []byte
	release func()   // after unmapping: unlinks the shm object
	ID      uint64   // the sidecar's rank id (after Open)
	Regions []uint64 // the registered regions' ids
	// VRAM registers the pool as GPU memory by CUDA IPC handle, in the
	// handle layout of the stand-in libcudart the tests load
	// (host/serve/engmem/testdata/cudart_standin.c): the pool's shm
	// object is the "device allocation".
	VRAM bool
	// RegisterAs, when set, is register_as of the pool's host-memory
	// region (without VRAM): "vram" has the sidecar register host memory
	// as GPU memory, which the fake plugin accepts.
	RegisterAs string
}

// geometry is the pool layout of rank tp of tpSize.
func geometry(s Shape, tpSize, tp int) (kvpool.Geometry, error) {
	g := kvpool.Geometry{
		Attention: kvpool.MHA, Order: kvpool.KThenV,
		Layers: s.Layers, Pages: s.Pages, PageSize: s.PageSize,
		TotalHeads: s.KVHeads, TPSize: tpSize, TPRank: tp, HeadBytes: s.HeadBytes,
		AuxItems: s.AuxItems, AuxItemLen: 64,
	}
	if s.MLA {
		g.Attention, g.TotalHeads = kvpool.MLA, 1
	}
	return g, g.Validate()
}

// PoolSize is the bytes of rank tp's pool.
func PoolSize(s Shape, tpSize, tp int) (uint64, error) {
	g, err := geometry(s, tpSize, tp)
	if err != nil {
		return 0, err
	}
	return g.Size(), nil
}

// NewRank creates a rank's pool in a fresh shared-memory object named
// name (a POSIX name: "/kvt-..."; at most 47 bytes without the slash for
// VRAM, the stand-in handle's limit).
func NewRank(name, role string, s Shape, tpSize, tp int) (*Rank, error) {
	size, err := PoolSize(s, tpSize, tp)
	if err != nil {
		return nil, err
	}
	path := "/dev/shm" + name
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	if err := f.Truncate(int64(size)); err != nil {
		os.Remove(path)
		return nil, err
	}
	r, err := NewRankFD(name, int(f.Fd()), func() { os.Remove(path) }, role, s, tpSize, tp)
	if err != nil {
		os.Remove(path)
	}
	return r, err
}

// NewRankFD makes a rank's pool of the file fd (at least PoolSize bytes;
// the caller keeps fd), which the sidecar finds as shm (register_memory's
// "shm" of the pool's region: a POSIX name, a path, or a memfd's
// "/proc/<pid>/fd/<n>"). release, when not nil, runs after the pool is
// unmapped in Close (it unlinks a shm object).
func NewRankFD(shm string, fd int, release func(), role string, s Shape, tpSize, tp int) (*Rank, error) {
	g, err := geometry(s, tpSize, tp)
	if err != nil {
		return nil, err
	}
	mem, err := syscall.Mmap(fd, 0, int(g.Size()), syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_SHARED) // kvpool.Wrap unmaps with syscall.Munmap
	if err != nil {
		return nil, err
	}
	pool, err := kvpool.Wrap(g, mem) // the pool unmaps mem on Close
	if err != nil {
		syscall.Munmap(mem)
		return nil, err
	}
	return &Rank{Role: role, TP: tp, TPSize: tpSize, Pool: pool, SHM: shm, mem: mem, release: release}, nil
}

// Close unmaps the pool (and unlinks its shm object). Calling it again
// does nothing.
func (r *Rank) Close() {
	r.Pool.Close()
	if r.release != nil {
		r.release()
	}
}

// Base is the engine's pointer to its pool.
func (r *Rank) Base() uint64 { return r.Pool.Regions()[0].Addr }

// MemRegions are the pool as register_memory's regions: one DRAM region,
// or with VRAM the KV as a VRAM region and aux (host memory in SGLang) as
// a DRAM region of the same object.
func (r *Rank) MemRegions() []client.Region {
	if !r.VRAM {
		return []client.Region{{Kind: "dram", Addr: r.Base(), Length: uint64(len(r.mem)), SHM: r.SHM, RegisterAs: r.RegisterAs}}
	}
	h := make([]byte, 64)
	copy(h, "KVSI")
	binary.LittleEndian.PutUint32(h[4:], 0)
	copy(h[8:55], strings.TrimPrefix(r.SHM, "/"))
	binary.LittleEndian.PutUint64(h[56:], uint64(len(r.mem)))
	kv := uint64(len(r.mem))
	out := []client.Region{}
	if aux := r.Pool.Aux(); aux.Len > 0 {
		kv = aux.Addr - r.Base()
		out = append(out, client.Region{Kind: "dram", Addr: aux.Addr, Length: aux.Len, SHM: r.SHM, Offset: kv})
	}
	return append(out, client.Region{Kind: "vram", Addr: r.Base(), Length: kv, CUDAIPC: h, Device: 0})
}

// Args are open_rank's SGLang fields for the pool.
func (r *Rank) Args(variant, bootstrap string) client.SGLangRank {
	g := r.Pool.Geometry()
	a := client.SGLangRank{Role: r.Role, PageSize: g.PageSize, KVHeadNum: g.HeadsLocal(), TotalKVHeadNum: g.TotalHeads,
		TPSize: r.TPSize, TPRank: r.TP, IsMLA: g.Attention == kvpool.MLA, Variant: variant, BootstrapAddr: bootstrap}
	for _, x := range r.Pool.Regions() {
		a.KVDataPtrs = append(a.KVDataPtrs, x.Addr)
		a.KVDataLens = append(a.KVDataLens, x.Len)
		a.KVItemLens = append(a.KVItemLens, g.ItemLen())
	}
	if aux := r.Pool.Aux(); aux.Len > 0 {
		a.AuxDataPtrs, a.AuxDataLens, a.AuxItemLens = []uint64{aux.Addr}, []uint64{aux.Len}, []uint64{uint64(g.AuxItemLen)}
	}
	return a
}

// Open registers the pool and opens the rank on the sidecar.
func (r *Rank) Open(ctx context.Context, c *client.Client, variant, bootstrap string) error {
	ids, err := c.RegisterMemory(ctx, r.MemRegions())
	if err != nil {
		return fmt.Errorf("register_memory: %w", err)
	}
	r.Regions = ids
	rk, err := c.OpenSGLang(ctx, r.Args(variant, bootstrap))
	if err != nil {
		return fmt.Errorf("open_rank: %w", err)
	}
	r.ID = rk.ID
	return nil
}

// Rooms tracks every room's state from a client's events.
type Rooms struct {
	mu     sync.Mutex
	cond   *sync.Cond
	states map[[2]uint64]client.Event
	closed bool
}

// Watch reads c's events until the connection ends.
func Watch(c *client.Client) *Rooms {
	w := &Rooms{states: make(map[[2]uint64]client.Event)}
	w.cond = sync.NewCond(&w.mu)
	go func() {
		for e := range c.Events() {
			if e.Name != "room" {
				continue
			}
			w.mu.Lock()
			k := [2]uint64{e.Rank, e.Room}
			if old, ok := w.states[k]; !ok || !terminal(old.State) {
				w.states[k] = e
			}
			w.cond.Broadcast()
			w.mu.Unlock()
		}
		w.mu.Lock()
		w.closed = true
		w.cond.Broadcast()
		w.mu.Unlock()
	}()
	return w
}

func terminal(st int) bool { return st == client.StateFailed || st == client.StateSuccess }

// Wait returns the room's event once its state is at least st (or Failed),
// or an error when ctx ends or the connection closed first.
func (w *Rooms) Wait(ctx context.Context, rank, room uint64, st int) (client.Event, error) {
	stop := context.AfterFunc(ctx, func() {
		w.mu.Lock()
		w.cond.Broadcast()
		w.mu.Unlock()
	})
	defer stop()
	w.mu.Lock()
	defer w.mu.Unlock()
	k := [2]uint64{rank, room}
	for {
		if e, ok := w.states[k]; ok && (e.State >= st || e.State == client.StateFailed) {
			return e, nil
		}
		if w.closed {
			return client.Event{}, fmt.Errorf("room %d: connection closed", room)
		}
		if ctx.Err() != nil {
			e := w.states[k]
			return client.Event{}, fmt.Errorf("room %d: waiting for state %d (at %d): %w", room, st, e.State, ctx.Err())
		}
		w.cond.Wait()
	}
}

// Forget drops a closed room's state.
func (w *Rooms) Forget(rank, room uint64) {
	w.mu.Lock()
	delete(w.states, [2]uint64{rank, room})
	w.mu.Unlock()
}
