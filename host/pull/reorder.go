package pull

import (
	"fmt"
	"sync/atomic"

	"github.com/kvhost/kvhost/host/internal/memfault"
)

// Reordering received blocks (vLLM's kv_connector/v1/nixl_connector.py's blocksize_post_process).
//
// When a decode block holds bsr prefill blocks, the READ fills it with bsr
// prefill-shaped chunks one after another: chunk c is [K_c][V_c] for a
// blocks-first layout, or just the tensor's block otherwise, each part laid
// out for prefill's block size Bp = Bd/bsr. The decode layout wants, per
// part, every head's Bd tokens together:
//
//	HND: part[h][c*Bp + t] = chunk_c.part[h][t]   (heads major)
//	NHD: part[c*Bp + t][h] = chunk_c.part[t][h]   (tokens major: chunks
//	     simply follow each other, so only blocks-first needs moving)
//
// MLA blocks are [tokens][latent] and always arrive in place.

// checkReorder reports whether this rank's geometry allows reordering
// blocks received from prefill blocks bsr times smaller.
func (r *Receiver) checkReorder(bsr int) error {
	c := &r.cfg.Cache
	if c.Host == nil {
		return fmt.Errorf("prefill blocks are %d times smaller than decode blocks and the %s layout needs the received blocks reordered, "+
			"but the decode cache gives no host view of its memory", bsr, c.Layout)
	}
	parts := r.parts()
	for i, l := range c.blockLens() {
		unit := uint64(parts) * uint64(r.headsLocal) * uint64(c.BlockSize)
		if l%unit != 0 {
			return fmt.Errorf("region %d: block of %d bytes is not %d parts × %d heads × %d tokens", i, l, parts, r.headsLocal, c.BlockSize)
		}
	}
	return nil
}

func (r *Receiver) parts() int {
	if r.cfg.BlocksFirst {
		return 2
	}
	return 1
}

// testHookBeforeReorder, when set by a test, runs before a READ's blocks
// are reordered (an engine shrinks its memory there).
var testHookBeforeReorder atomic.Pointer[func()]

// reorder rearranges the given local blocks of every region in place.
// The regions are the engine's memory, which it may shrink or unmap: a
// fault fails this load with an error naming the region, not the process.
func (r *Receiver) reorder(blocks []int32, bsr int) error {
	if hook := testHookBeforeReorder.Load(); hook != nil {
		(*hook)()
	}
	c := &r.cfg.Cache
	r.reorderMu.Lock()
	defer r.reorderMu.Unlock()
	hnd := c.Layout == LayoutHND
	for i, l := range c.blockLens() {
		if uint64(cap(r.reorderBuf)) < l {
			r.reorderBuf = make([]byte, l)
		}
		scratch := r.reorderBuf[:l]
		host := c.Host[i]
		for _, b := range blocks {
			if b < 0 || uint64(b)*l+l > uint64(len(host)) {
				return fmt.Errorf("pull: reorder: block %d outside region %d", b, i)
			}
		}
		var at int32 // the block being reordered, for the error
		err := memfault.Do("", func() {
			for _, b := range blocks {
				at = b
				off := uint64(b) * l
				reorderBlock(host[off:off+l], scratch, r.parts(), r.headsLocal, c.BlockSize, bsr, hnd)
			}
		})
		if fe, ok := err.(*memfault.Error); ok {
			fe.What = fmt.Sprintf("pull: reorder of block %d in KV region %d (kv_caches_base_addr[%d])", at, i, i)
			return fe
		}
	}
	return nil
}

// reorderBlock rearranges one decode block (see above); scratch is as long
// as blk.
func reorderBlock(blk, scratch []byte, parts, heads, bd, bsr int, hnd bool) {
	if !hnd && parts == 1 {
		return
	}
	copy(scratch, blk)
	partLen := len(blk) / parts
	sub := partLen / bsr // one part of one chunk
	chunk := len(blk) / bsr
	bp := bd / bsr
	d := partLen / (heads * bd) // bytes of one head of one token
	for c := 0; c < bsr; c++ {
		for p := 0; p < parts; p++ {
			src := scratch[c*chunk+p*sub : c*chunk+(p+1)*sub]
			dst := blk[p*partLen : (p+1)*partLen]
			if !hnd {
				copy(dst[c*sub:(c+1)*sub], src)
				continue
			}
			run := bp * d
			for h := 0; h < heads; h++ {
				copy(dst[(h*bd+c*bp)*d:(h*bd+c*bp)*d+run], src[h*run:(h+1)*run])
			}
		}
	}
}
