package planjson

import (
	"bufio"
	"encoding/json"
	"io"
	"strconv"

	"github.com/kvhost/kvhost/planner"
)

// Response is the JSON answer of `kvhost plan` without its copies, which
// WriteResponse streams (a plan can run to millions of copies).
type Response struct {
	Style string `json:"style"`
	Kind  string `json:"kind"`
	// Path names the upstream code path reproduced.
	Path string `json:"path"`
	// Descriptors is how many (strided) descriptors the backend is handed.
	Descriptors int `json:"descriptors"`
	// ExpandedDescriptors is how many plain blocks those stand for.
	ExpandedDescriptors uint64 `json:"expanded_descriptors"`
	// Bytes is the total moved.
	Bytes uint64 `json:"bytes"`
	// ReferenceDescriptors is what SGLang's disaggregation/{nixl,mori}/conn.py would hand its
	// backend for the same bytes (omitted when not computed).
	ReferenceDescriptors uint64 `json:"reference_descriptors,omitempty"`
	// Parts lists separately posted transfers (mixed memory kinds).
	Parts []PartJSON `json:"parts,omitempty"`
}

// PartJSON is one separately posted transfer of the plan, with the
// notification suffix SGLang's disaggregation/{nixl,mori}/conn.py appends to the chunk's notification
// (SGLang NIXL mixed memory: "_part_{i}_{n}").
type PartJSON struct {
	Descriptors int    `json:"descriptors"`
	Bytes       uint64 `json:"bytes"`
	SrcKind     string `json:"src_mem_kind"`
	DstKind     string `json:"dst_mem_kind"`
	NotifSuffix string `json:"notif_suffix"`
}

// MaxResponseBlocks bounds the blocks WriteResponse lists (about 4 GiB of
// JSON); real plans stay far below (80 layers x 1024 pages x 16 tokens is
// 2.6 million).
const MaxResponseBlocks = 1 << 27

// NewResponse summarizes a plan.
func NewResponse(env Envelope, p *planner.Plan) Response {
	r := Response{
		Style:                env.Style,
		Kind:                 env.Kind,
		Path:                 p.Path,
		Descriptors:          p.Descriptors(),
		ExpandedDescriptors:  p.ExpandedDescriptors(),
		Bytes:                p.Bytes(),
		ReferenceDescriptors: p.ReferenceDescriptors,
	}
	for i, pt := range p.Parts {
		var b uint64
		for _, c := range p.Copies[pt.Start:pt.End] {
			b += c.Bytes()
		}
		suffix := pt.NotifSuffix
		if suffix == "" {
			suffix = planner.PartNotifSuffix(i, len(p.Parts))
		}
		r.Parts = append(r.Parts, PartJSON{
			Descriptors: pt.End - pt.Start,
			Bytes:       b,
			SrcKind:     pt.SrcKind.String(),
			DstKind:     pt.DstKind.String(),
			NotifSuffix: suffix,
		})
	}
	return r
}

// WriteResponse writes the response JSON of a plan: the summary fields and,
// unless summary is set, "copies": every block as [prefill_addr,
// decode_addr, len], blocks adjacent on both sides merged. Output ends with
// a newline.
//
// A plan that expands to more than MaxResponseBlocks blocks is refused
// unless summary is set: printing it would take hours.
func WriteResponse(w io.Writer, env Envelope, p *planner.Plan, summary bool) error {
	resp := NewResponse(env, p)
	if !summary && resp.ExpandedDescriptors > MaxResponseBlocks {
		return errorf("", "plan expands to %d blocks, more than the %d a response lists; ask for the summary", resp.ExpandedDescriptors, uint64(MaxResponseBlocks))
	}
	head, err := json.Marshal(resp)
	if err != nil {
		return err
	}
	bw := bufio.NewWriterSize(w, 1<<16)
	if summary {
		bw.Write(head)
		bw.WriteByte('\n')
		return bw.Flush()
	}
	bw.Write(head[:len(head)-1]) // reopen the object
	bw.WriteString(`,"copies":[`)
	first := true
	var cur [3]uint64
	var buf []byte
	flush := func() {
		if cur[2] == 0 {
			return
		}
		if !first {
			bw.WriteByte(',')
		}
		first = false
		buf = append(buf[:0], '[')
		buf = strconv.AppendUint(buf, cur[0], 10)
		buf = append(buf, ',')
		buf = strconv.AppendUint(buf, cur[1], 10)
		buf = append(buf, ',')
		buf = strconv.AppendUint(buf, cur[2], 10)
		buf = append(buf, ']')
		bw.Write(buf)
	}
	p.ForEachBlock(func(src, dst, length uint64) bool {
		if cur[2] != 0 && src == cur[0]+cur[2] && dst == cur[1]+cur[2] {
			cur[2] += length
			return true
		}
		flush()
		cur = [3]uint64{src, dst, length}
		return true
	})
	flush()
	bw.WriteString("]}\n")
	return bw.Flush()
}
