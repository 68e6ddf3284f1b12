package fakeengine

import (
	"context"
	"fmt"

	"github.com/kvhost/kvhost/host/demo/kvpool"
	"github.com/kvhost/kvhost/host/serve/client"
)

// Request is one request both sides agree on.
type Request struct {
	Room   uint64
	Tokens int
	// Chunk is the pages per sender_send (0: all at once).
	Chunk int
	// NoBytes skips filling and verifying the KV (benchmarks, and engines
	// that shrink their memory under the sidecar).
	NoBytes bool
	// AfterChunk, when set, runs on the prefill after it started sending
	// chunk i (0, 1, ...): a test does what an engine might between chunks.
	AfterChunk func(i int)
}

// pagesFor is the page count of n tokens.
func pagesFor(n, ps int) int { return (n + ps - 1) / ps }

// blockPages is the pages each room may use: room r uses block
// r % (pool pages / blockPages), so rooms in flight together must differ
// modulo the block count.
const blockPages = 16

// block returns the first page of the room's block and the page count.
func block(r *Rank, q Request) (first, n int) {
	g := r.Pool.Geometry()
	n = pagesFor(q.Tokens, g.PageSize)
	per := max(blockPages, n)
	blocks := max(g.Pages/per, 1)
	return int(q.Room%uint64(blocks)) * per, n
}

// PrefillPages are the prefill rank's pages of a request: its block, in a
// spread order (stride 3).
func PrefillPages(r *Rank, q Request) []int32 {
	first, n := block(r, q)
	per := max(blockPages, n)
	out := make([]int32, n)
	seen := make(map[int]bool, n)
	for i := range out {
		x := (i * 3) % per
		for seen[x] {
			x = (x + 1) % per
		}
		seen[x] = true
		out[i] = int32(first + x)
	}
	return out
}

// DecodePages are the decode rank's pages of a request: its block, in
// reverse order.
func DecodePages(r *Rank, q Request) []int32 {
	first, n := block(r, q)
	per := max(blockPages, n)
	out := make([]int32, n)
	for i := range out {
		out[i] = int32(first + per - 1 - i)
	}
	return out
}

// AuxSlot is both sides' aux slot of a request.
func AuxSlot(r *Rank, q Request) int {
	return int(q.Room % uint64(r.Pool.Geometry().AuxItems))
}

// Prefill runs one request on a prefill rank as SGLang's KVSender does:
// create, wait for decode's metadata, init, fill and send the pages in
// chunks, wait for Success, close. It returns the room's failure reason
// as an error.
func Prefill(ctx context.Context, c *client.Client, w *Rooms, r *Rank, q Request) error {
	if err := c.SenderCreate(ctx, r.ID, q.Room); err != nil {
		return err
	}
	defer func() {
		// Not waited for: the next request need not wait a round trip.
		c.StartCloseRoom(context.WithoutCancel(ctx), r.ID, q.Room)
		w.Forget(r.ID, q.Room)
	}()
	e, err := w.Wait(ctx, r.ID, q.Room, client.StateWaitingForInput)
	if err != nil {
		return err
	}
	if e.State == client.StateFailed {
		return fmt.Errorf("room %d failed: %s", q.Room, e.Reason)
	}
	pages := PrefillPages(r, q)
	aux := AuxSlot(r, q)
	if err := fill(!q.NoBytes, func() error { return r.Pool.FillAux(q.Room, aux) }); err != nil {
		return err
	}
	if err := c.SenderInit(ctx, r.ID, q.Room, len(pages), int64(aux)); err != nil {
		return err
	}
	if err := fill(!q.NoBytes, func() error {
		return r.Pool.Fill(kvpool.Tokens{Request: q.Room, Pages: pages, First: 0, Count: q.Tokens})
	}); err != nil {
		return err
	}
	chunk := q.Chunk
	if chunk <= 0 {
		chunk = len(pages)
	}
	// The chunks are pipelined (each started before the previous one's
	// reply), as an engine whose chunks are ready at once would.
	var sends []*client.Pending
	for sent := 0; sent < len(pages); sent += chunk {
		n := min(chunk, len(pages)-sent)
		sends = append(sends, c.StartSenderSend(ctx, r.ID, q.Room, pages[sent:sent+n], nil))
		if q.AfterChunk != nil {
			q.AfterChunk(len(sends) - 1)
		}
	}
	for _, p := range sends {
		if _, err := p.Wait(ctx); err != nil {
			return err
		}
	}
	e, err = w.Wait(ctx, r.ID, q.Room, client.StateSuccess)
	if err != nil {
		return err
	}
	if e.State != client.StateSuccess {
		return fmt.Errorf("room %d failed: %s", q.Room, e.Reason)
	}
	return nil
}

// Decode runs one request on a decode rank as SGLang's KVReceiver does:
// create (bootstrap), wait for WaitingForInput, clear its pages, init,
// wait for Success, then verify every byte of the request's KV and aux in
// the rank's own memory.
func Decode(ctx context.Context, c *client.Client, w *Rooms, r *Rank, boot string, q Request) error {
	if err := c.ReceiverCreate(ctx, r.ID, q.Room, boot, -1); err != nil {
		return err
	}
	defer func() {
		// Not waited for: the next request need not wait a round trip.
		c.StartCloseRoom(context.WithoutCancel(ctx), r.ID, q.Room)
		w.Forget(r.ID, q.Room)
	}()
	e, err := w.Wait(ctx, r.ID, q.Room, client.StateWaitingForInput)
	if err != nil {
		return err
	}
	if e.State == client.StateFailed {
		return fmt.Errorf("room %d failed: %s", q.Room, e.Reason)
	}
	pages := DecodePages(r, q)
	aux := AuxSlot(r, q)
	if !q.NoBytes {
		if err := r.Pool.ClearPages(pages); err != nil {
			return err
		}
		g := r.Pool.Geometry()
		a := r.Pool.Aux()
		off := a.Addr - r.Base() + uint64(aux*g.AuxItemLen)
		clear(r.Pool.Bytes()[off : off+uint64(g.AuxItemLen)])
	}
	if err := c.ReceiverInit(ctx, r.ID, q.Room, pages, int64(aux), nil, 0); err != nil {
		return err
	}
	e, err = w.Wait(ctx, r.ID, q.Room, client.StateSuccess)
	if err != nil {
		return err
	}
	if e.State != client.StateSuccess {
		return fmt.Errorf("room %d failed: %s", q.Room, e.Reason)
	}
	if q.NoBytes {
		return nil
	}
	if err := r.Pool.Verify(kvpool.Tokens{Request: q.Room, Pages: pages, First: 0, Count: q.Tokens}); err != nil {
		return fmt.Errorf("room %d: verify: %w", q.Room, err)
	}
	if err := r.Pool.VerifyAux(q.Room, aux); err != nil {
		return fmt.Errorf("room %d: verify aux: %w", q.Room, err)
	}
	return nil
}

// fill runs fn when do is set.
func fill(do bool, fn func() error) error {
	if !do {
		return nil
	}
	return fn()
}
