package planner

import (
	"fmt"
	"slices"
)

// Per-request planning of vLLM pull reads (_read_blocks_for_req,
// _read_blocks, get_mapped_blocks, _get_block_descs_ids).
//
// A request names its decode blocks (local_block_ids, logical) and the
// prefill's blocks (remote_block_ids). In order:
//  1. both lists expand by PhysicalBlocksPerLogical
//     (_logical_to_kernel_block_ids);
//  2. with decode blocks BlockSizeRatio times larger than prefill blocks,
//     every decode block becomes BlockSizeRatio sub-blocks of prefill size
//     (get_mapped_blocks), and the local list is clipped to the remote
//     list's length;
//  3. an empty local list is a full prefix hit: nothing is read and the
//     prefill is only notified;
//  4. a shorter local list is a partial prefix hit: only the last
//     len(local) remote blocks are read (with a block-size ratio, kvhost
//     first aligns the remote list to the decode blocks: VLLMAlignRemote);
//  5. descriptor ids are virtual region × blocks per region + block, every
//     region in turn; a layer with a block window reads only the last
//     window blocks of both lists.
//
// Ids are computed on the fly from the inputs: nothing is allocated per
// block or per descriptor.

// vllmSeq is a block id list after expansion: element k is
// ids[k/factor]*factor + k%factor, for k < n (n may clip the expansion).
type vllmSeq struct {
	ids    []int32
	factor int
	n      int
}

// vllmCursor walks a vllmSeq from some element on, without a division per
// element.
type vllmCursor struct {
	s    *vllmSeq
	i, o int // input id index and offset within its expansion
}

func (s *vllmSeq) cursor(k int) vllmCursor { return vllmCursor{s: s, i: k / s.factor, o: k % s.factor} }

func (c *vllmCursor) next() int {
	v := int(c.s.ids[c.i])*c.s.factor + c.o
	if c.o++; c.o == c.s.factor {
		c.o, c.i = 0, c.i+1
	}
	return v
}

// appendRange appends base + elements [from, to) of s to dst.
func (s *vllmSeq) appendRange(dst []int32, from, to, base int) []int32 {
	if s.factor == 1 {
		k := len(dst)
		dst = slices.Grow(dst, to-from)[:k+to-from]
		out := dst[k:]
		for i, id := range s.ids[from:to] {
			out[i] = int32(base + int(id))
		}
		return dst
	}
	c := s.cursor(from)
	for k := from; k < to; k++ {
		dst = append(dst, int32(base+c.next()))
	}
	return dst
}

// vllmReq is one request resolved against a reader: the expanded lists and
// where reading starts in the remote one.
type vllmReq struct {
	local, remote vllmSeq
	// remoteStart is the index in remote of the block read with local[0].
	remoteStart int
}

// resolve applies steps 1 to 4 and checks every block id that will be read.
// It returns notifyOnly for a full prefix hit.
func (r *VLLMReader) resolve(local, remote []int32) (q vllmReq, notifyOnly bool, err error) {
	kf := r.kernelFactor
	q.remote = vllmSeq{ids: remote, factor: kf, n: len(remote) * kf}
	q.local = vllmSeq{ids: local, factor: kf * r.blockSizeRatio, n: len(local) * kf * r.blockSizeRatio}
	if r.blockSizeRatio > 1 && q.local.n > q.remote.n {
		q.local.n = q.remote.n
	}
	if q.local.n == 0 {
		return q, true, nil
	}
	if q.local.n > q.remote.n {
		return q, false, errorf("local_block_ids", "%d decode blocks to read but the prefill sent only %d blocks", q.local.n, q.remote.n)
	}
	q.remoteStart = q.remote.n - q.local.n

	// Only blocks some region reads need to exist: the widest window.
	first := 0
	if r.windows != nil {
		first = q.local.n
		for _, w := range r.windows {
			first = min(first, windowStart(q.local.n, w))
		}
	}
	if err := checkSeq("local_block_ids", &q.local, first, q.local.n, r.local.Blocks); err != nil {
		return q, false, err
	}
	if err := checkSeq("remote_block_ids", &q.remote, q.remoteStart+first, q.remote.n, r.remote.Blocks); err != nil {
		return q, false, err
	}
	return q, false, nil
}

// windowStart is the first index of the last w of n blocks (Python's
// ids[-w:], where w == 0 keeps everything).
func windowStart(n, w int) int {
	if w == 0 || w >= n {
		return 0
	}
	return n - w
}

// checkSeq checks that elements [from, to) of s name one of blocks blocks.
// It checks per input id, so it runs in O(len(ids)).
func checkSeq(field string, s *vllmSeq, from, to, blocks int) error {
	if from >= to {
		return nil
	}
	f := int64(s.factor)
	for i := from / s.factor; i <= (to-1)/s.factor; i++ {
		id := int64(s.ids[i])
		// The last expanded id of this input id that is read.
		hi := min(int64(to), (int64(i)+1)*f) - 1 - int64(i)*f
		if id >= 0 && id*f+hi < int64(blocks) {
			continue
		}
		if blocks%s.factor == 0 {
			return errorf(fmt.Sprintf("%s[%d]", field, i), "block %d outside [0, %d)", id, blocks/s.factor)
		}
		return errorf(fmt.Sprintf("%s[%d]", field, i), "block %d expands past the %d blocks of the descriptor list", id, blocks)
	}
	return nil
}

// VLLMAlignRemote returns the prefill blocks (remote_block_ids) that
// kvhost's pull runtime hands to the reader for a request of nLocal decode
// blocks, when decode blocks are blockSizeRatio prefill blocks long. It is
// where kvhost deliberately differs from vLLM: on a partial prefix hit,
// vLLM's _read_blocks_for_req reads the last nLocal × ratio prefill
// blocks (remote_block_ids[-n:]), which lands the tokens in the wrong
// decode blocks unless the request's last decode block is full of prefill
// blocks. The request spans ceil(len(remote)/ratio) decode blocks and the
// last nLocal are read, so kvhost first drops the prefill blocks of the hit
// decode blocks (the reader then clips the last, partial decode block as
// vLLM does). Both agree whenever vLLM is right: no hit, or a last decode
// block that is full. With a ratio of 1 the reader's tail is already right
// and remote is returned as is.
//
// The pull runtime (host/pull) and `kvhost plan` both call it, so the plan
// shows what the runtime reads.
func VLLMAlignRemote(nLocal int, remote []int32, blockSizeRatio int) []int32 {
	if blockSizeRatio <= 1 {
		return remote
	}
	spans := (len(remote) + blockSizeRatio - 1) / blockSizeRatio
	if hit := spans - nLocal; hit > 0 {
		return remote[min(hit*blockSizeRatio, len(remote)):]
	}
	return remote
}

// AlignRemote is VLLMAlignRemote with this reader's block-size ratio.
func (r *VLLMReader) AlignRemote(nLocal int, remote []int32) []int32 {
	return VLLMAlignRemote(nLocal, remote, r.blockSizeRatio)
}

// VLLMRead is the prepped form of one request's READ.
type VLLMRead struct {
	// NotifyOnly is a full prefix hit: nothing to read; send only the
	// notification to the prefill rank.
	NotifyOnly bool
	// LocalIDs index the reader's LocalList and RemoteIDs its RemoteList;
	// descriptor LocalIDs[k] receives descriptor RemoteIDs[k]. Both have the
	// same length.
	LocalIDs  []int32
	RemoteIDs []int32
}

// Read returns the descriptor ids of one request (local ids are the decode
// blocks, logical; remote ids the prefill's remote_block_ids). It allocates
// the two id arrays and nothing else; AppendRead reuses caller buffers.
//
// Decode block ids must be distinct, as vLLM's scheduler allocates them;
// that is not checked here (it would cost a set per request). Ids are
// checked against the lists only where a block is actually read.
func (r *VLLMReader) Read(localBlockIDs, remoteBlockIDs []int32) (VLLMRead, error) {
	n, notify, err := r.ReadLen(localBlockIDs, remoteBlockIDs)
	if err != nil || notify {
		return VLLMRead{NotifyOnly: notify}, err
	}
	l, rm, _, err := r.AppendRead(make([]int32, 0, n), make([]int32, 0, n), localBlockIDs, remoteBlockIDs)
	return VLLMRead{LocalIDs: l, RemoteIDs: rm}, err
}

// ReadLen returns how many descriptor ids (per side) the request needs, and
// whether it is a full prefix hit.
func (r *VLLMReader) ReadLen(localBlockIDs, remoteBlockIDs []int32) (n int, notifyOnly bool, err error) {
	q, notify, err := r.resolve(localBlockIDs, remoteBlockIDs)
	if err != nil || notify {
		return 0, notify, err
	}
	for j := range r.local.Regions {
		n += q.local.n - r.windowStartOf(j, q.local.n)
	}
	return n, false, nil
}

func (r *VLLMReader) windowStartOf(j, n int) int {
	if r.windows == nil {
		return 0
	}
	return windowStart(n, r.windows[j])
}

// AppendRead appends the request's local and remote descriptor ids to
// localDst and remoteDst and returns the extended slices. It allocates only
// if the slices lack capacity. On error both are returned at their original
// lengths.
func (r *VLLMReader) AppendRead(localDst, remoteDst []int32, localBlockIDs, remoteBlockIDs []int32) (localIDs, remoteIDs []int32, notifyOnly bool, err error) {
	q, notify, err := r.resolve(localBlockIDs, remoteBlockIDs)
	if err != nil || notify {
		return localDst, remoteDst, notify, err
	}
	n := q.local.n
	total := 0
	for j := range r.local.Regions {
		total += n - r.windowStartOf(j, n)
	}
	localDst, remoteDst = slices.Grow(localDst, total), slices.Grow(remoteDst, total)
	lb, rb := r.local.Blocks, r.remote.Blocks
	l0, r0, from0 := len(localDst), len(remoteDst), -1
	for j := range r.local.Regions {
		// Ids fit int32: NewVLLMReader bounds both list lengths.
		from := r.windowStartOf(j, n)
		if j > 0 && from == from0 {
			// Region j reads the blocks region 0 reads: its ids are
			// region 0's plus j list blocks (ids are non-negative and
			// in range, checked by resolve).
			m := n - from
			l, rm := len(localDst), len(remoteDst)
			localDst, remoteDst = localDst[:l+m], remoteDst[:rm+m]
			addInt32(localDst[l:], localDst[l0:l0+m], int32(j*lb))
			addInt32(remoteDst[rm:], remoteDst[r0:r0+m], int32(j*rb))
			continue
		}
		if j == 0 {
			from0 = from
		}
		localDst = q.local.appendRange(localDst, from, n, j*lb)
		remoteDst = q.remote.appendRange(remoteDst, q.remoteStart+from, q.remoteStart+n, j*rb)
	}
	return localDst, remoteDst, false, nil
}

// Plan paths of vLLM pull plans.
const (
	PathVLLMRead       = "vllm-read"
	PathVLLMNotifyOnly = "vllm-notify-only"
)

// Plan fills p with the request's READ as a strided copy plan, like every
// planner's Plan: prefill-side indices first (the prefill's
// remote_block_ids), then decode-side ones (this rank's local block ids),
// the reverse of Read's vLLM order. Src are the prefill rank's regions, Dst
// this decode rank's. Runs of consecutive blocks become one copy per
// region (one plain block when the slices are contiguous, else a strided
// copy over the blocks' head slices), and the K and V halves of a
// blocks-first block merge when they are adjacent on both sides. A full
// prefix hit gives a plan without copies (Path "vllm-notify-only").
//
// p is Reset and refilled, keeping its capacity, so planning allocates
// nothing once p has grown. p.Src and p.Dst are borrowed from the reader.
//
// Runs of blocks consecutive on both sides are the same for every region,
// so they are found once (in batches of vllmRunBatch, on the stack) and
// then turned into one copy per region each: O(blocks + regions × runs).
func (r *VLLMReader) Plan(p *Plan, prefillBlockIDs, decodeBlockIDs []int32) error {
	localBlockIDs, remoteBlockIDs := decodeBlockIDs, prefillBlockIDs
	p.Reset()
	q, notify, err := r.resolve(localBlockIDs, remoteBlockIDs)
	if err != nil {
		return err
	}
	p.Src, p.Dst = r.src, r.dst
	if notify {
		p.Path = PathVLLMNotifyOnly
		return nil
	}
	p.Path = PathVLLMRead
	n := q.local.n
	first := n
	for j := range r.local.Regions {
		from := r.windowStartOf(j, n)
		first = min(first, from)
		p.ReferenceDescriptors += uint64(n - from)
	}
	var buf [vllmRunBatch]vllmRun
	sc := vllmRunScanner{lc: q.local.cursor(first), rc: q.remote.cursor(q.remoteStart + first), k: first, n: n}
	for runs := sc.fill(buf[:0]); len(runs) > 0; runs = sc.fill(buf[:0]) {
		nv := len(r.local.Regions)
		for j := 0; j < nv; j++ {
			lr, rr := &r.local.Regions[j], &r.remote.Regions[j]
			segLen := lr.Len
			from := r.windowStartOf(j, n)
			// Blocks-first: K (region j) and V (region j+1) of one tensor
			// are adjacent on both sides when this rank reads whole halves.
			if j+1 < nv && r.mergeable(j, from, n) {
				segLen *= 2
				j++
			}
			addRuns(p, runs, lr, rr, segLen, from)
		}
	}
	return nil
}

// vllmRunBatch is how many runs Plan finds before emitting copies: a
// stack buffer of 16 KiB.
const vllmRunBatch = 512

// vllmRun is m blocks read from k on: local ids lid..lid+m-1 from remote ids
// rid..rid+m-1.
type vllmRun struct{ k, lid, rid, m int }

// vllmRunScanner splits a request's block pairs into runs consecutive on
// both sides, in batches.
type vllmRunScanner struct {
	lc, rc  vllmCursor
	k, n    int
	pending vllmRun // the run being extended (m > 0) across fills
	lastLID int
	lastRID int
}

// fill appends up to cap(dst) complete runs and returns them; an empty
// result means the request is exhausted.
func (s *vllmRunScanner) fill(dst []vllmRun) []vllmRun {
	for s.k < s.n {
		lid, rid := s.lc.next(), s.rc.next()
		if s.pending.m > 0 && lid == s.lastLID+1 && rid == s.lastRID+1 {
			s.pending.m++
		} else {
			if s.pending.m > 0 {
				if len(dst) == cap(dst) {
					// Out of room: leave this block for the next fill.
					s.lc.i, s.lc.o = rewind(s.lc)
					s.rc.i, s.rc.o = rewind(s.rc)
					return dst
				}
				dst = append(dst, s.pending)
			}
			s.pending = vllmRun{k: s.k, lid: lid, rid: rid, m: 1}
		}
		s.lastLID, s.lastRID = lid, rid
		s.k++
	}
	if s.pending.m > 0 && len(dst) < cap(dst) {
		dst = append(dst, s.pending)
		s.pending.m = 0
	}
	return dst
}

// rewind steps a cursor back by one element.
func rewind(c vllmCursor) (i, o int) {
	if c.o == 0 {
		return c.i - 1, c.s.factor - 1
	}
	return c.i, c.o - 1
}

// mergeable reports whether virtual regions j and j+1 are the K and V
// halves of one blocks-first tensor whose slices touch on both sides.
func (r *VLLMReader) mergeable(j, from, n int) bool {
	l0, l1 := &r.local.Regions[j], &r.local.Regions[j+1]
	r0, r1 := &r.remote.Regions[j], &r.remote.Regions[j+1]
	return l0.Region == l1.Region && r0.Region == r1.Region &&
		l1.Off == l0.Off+l0.Len && r1.Off == r0.Off+r0.Len &&
		r.windowStartOf(j+1, n) == from
}

// addRuns adds the copies of one (possibly merged) region: one per run,
// skipping the blocks before from (a window).
func addRuns(p *Plan, runs []vllmRun, lr, rr *VLLMListRegion, segLen uint64, from int) {
	for _, run := range runs {
		if run.k+run.m <= from {
			continue
		}
		lid, rid, m := run.lid, run.rid, run.m
		if d := from - run.k; d > 0 {
			lid, rid, m = lid+d, rid+d, m-d
		}
		c := Copy{
			SrcRegion: int32(rr.Region),
			DstRegion: int32(lr.Region),
			SrcOff:    rr.Off + uint64(rid)*rr.Stride,
			DstOff:    lr.Off + uint64(lid)*lr.Stride,
			Len:       segLen,
			SrcStride: rr.Stride,
			DstStride: lr.Stride,
			Count:     uint64(m),
		}
		if m == 1 {
			c.SrcStride, c.DstStride = 0, 0
		} else if segLen == rr.Stride && segLen == lr.Stride {
			// Whole blocks back to back on both sides: one plain block.
			c.Len, c.Count, c.SrcStride, c.DstStride = segLen*uint64(m), 1, 0, 0
		}
		p.Add(c)
	}
}
