package sglang

import (
	"errors"
	"fmt"
	"strconv"
	"strings"
)

// Notification tags: the messages NIXL delivers to decode's agent along
// with each transfer, telling it what arrived. Grammar (underscore-
// separated, parsed like NixlKVManager.update_transfer_status):
//
//	{room}_kv_{chunk}_{last}_{pp}                     one KV chunk
//	{room}_kv_{chunk}_{last}_{pp}_part_{i}_{n}        part i of n of a KV chunk (mixed memory kinds)
//	{room}_aux                                        aux data (KV was sent)
//	{room}_aux_nokv_{pp}                              aux data; this PP rank sent no KV (prefix hit)
//	{room}_state_{pp}_{component}                     state of one component (maybe_send_extra appends _{i})
//	{room}_stg_{chunk}_{last}_{pp}_{idx}_{start}_{pages}_{agent}  staging chunk (agent may contain '_')
//
// {last} is 0 or 1; the room is the request's bootstrap room.

// NotifKind is the kind of a notification tag.
type NotifKind int

// Kinds of notification tags.
const (
	NotifKV NotifKind = iota
	NotifAux
	NotifState
	NotifStaging
)

func (k NotifKind) String() string {
	return [...]string{"kv", "aux", "state", "stg"}[k]
}

// Notif is a parsed notification tag. Which fields are meaningful depends
// on Kind; the rest are zero.
type Notif struct {
	Room uint64
	Kind NotifKind

	Chunk  int  // KV, staging: chunk id
	Last   bool // KV, staging: last chunk of the request
	PPRank int  // KV, staging, state, aux with NoKV

	// KV parts: NumParts > 0 when the chunk was split by memory kind.
	Part, NumParts int

	NoKV bool // aux: this PP rank sent no KV pages

	Component int // state: component index, -1 when the tag has none

	// Staging only.
	StagingChunkIdx, PageStart, NumPages int
	AgentName                            string
}

// KVNotif formats the tag of one KV chunk.
func KVNotif(room uint64, chunk int, last bool, pp int) string {
	return fmt.Sprintf("%d_kv_%d_%d_%d", room, chunk, b2i(last), pp)
}

// KVPartNotif formats the tag of part i of n of a KV chunk.
func KVPartNotif(room uint64, chunk int, last bool, pp, part, numParts int) string {
	return fmt.Sprintf("%s_part_%d_%d", KVNotif(room, chunk, last, pp), part, numParts)
}

// AuxNotif formats the tag of aux data after KV was sent.
func AuxNotif(room uint64) string { return fmt.Sprintf("%d_aux", room) }

// AuxNoKVNotif formats the tag of aux data from a PP rank that sent no KV.
func AuxNoKVNotif(room uint64, pp int) string { return fmt.Sprintf("%d_aux_nokv_%d", room, pp) }

// StateNotif formats the tag of one state component.
func StateNotif(room uint64, pp, component int) string {
	return fmt.Sprintf("%d_state_%d_%d", room, pp, component)
}

func b2i(b bool) int {
	if b {
		return 1
	}
	return 0
}

// ErrBadNotif marks a notification that does not follow the grammar.
var ErrBadNotif = errors.New("sglang: malformed notification tag")

// ParseNotif parses a notification tag. It is stricter than SGLang's disaggregation/{nixl,mori}/conn.py
// (which ignores trailing fields): a tag with fields the grammar does not
// have is an error.
func ParseNotif(tag []byte) (Notif, error) {
	s := string(tag)
	fail := func(format string, args ...any) (Notif, error) {
		return Notif{}, fmt.Errorf("%w %q: %s", ErrBadNotif, truncate(tag), fmt.Sprintf(format, args...))
	}
	c := strings.SplitN(s, "_", 9)
	if len(c) < 2 {
		return fail("no tag")
	}
	room, err := strconv.ParseUint(c[0], 10, 64)
	if err != nil || !isDecimal([]byte(c[0])) {
		return fail("room %q is not a number", c[0])
	}
	n := Notif{Room: room, Component: -1}
	nums := func(fields []string) ([]int, error) {
		out := make([]int, len(fields))
		for i, f := range fields {
			if f == "" || len(f) > 10 || !isDecimal([]byte(f)) || f[0] == '-' {
				return nil, fmt.Errorf("field %q is not a non-negative number", f)
			}
			v, err := strconv.Atoi(f)
			if err != nil {
				return nil, err
			}
			out[i] = v
		}
		return out, nil
	}
	switch c[1] {
	case "kv":
		n.Kind = NotifKV
		var fields []string
		switch {
		case len(c) == 4: // older senders: no PP rank (0)
			fields = append(c[2:4:4], "0")
		case len(c) == 5:
			fields = c[2:5]
		case len(c) == 8 && c[5] == "part":
			fields = append(c[2:5:5], c[6:8]...)
		default:
			return fail("kv tag has %d fields", len(c))
		}
		v, err := nums(fields)
		if err != nil {
			return fail("%v", err)
		}
		n.Chunk, n.Last, n.PPRank = v[0], v[1] != 0, v[2]
		if len(c) == 8 {
			n.Part, n.NumParts = v[3], v[4]
			if n.NumParts == 0 || n.Part >= n.NumParts {
				return fail("part %d of %d", n.Part, n.NumParts)
			}
		}
	case "aux":
		n.Kind = NotifAux
		switch {
		case len(c) == 2:
		case len(c) == 4 && c[2] == "nokv":
			v, err := nums(c[3:4])
			if err != nil {
				return fail("%v", err)
			}
			n.NoKV, n.PPRank = true, v[0]
		default:
			return fail("aux tag has %d fields", len(c))
		}
	case "state":
		n.Kind = NotifState
		if len(c) < 3 || len(c) > 4 {
			return fail("state tag has %d fields", len(c))
		}
		v, err := nums(c[2:])
		if err != nil {
			return fail("%v", err)
		}
		n.PPRank = v[0]
		if len(v) == 2 {
			n.Component = v[1]
		}
	case "stg":
		n.Kind = NotifStaging
		if len(c) != 9 {
			return fail("stg tag has %d fields", len(c))
		}
		v, err := nums(c[2:8])
		if err != nil {
			return fail("%v", err)
		}
		n.Chunk, n.Last, n.PPRank = v[0], v[1] != 0, v[2]
		n.StagingChunkIdx, n.PageStart, n.NumPages = v[3], v[4], v[5]
		n.AgentName = c[8]
	default:
		return fail("unknown tag %q", c[1])
	}
	return n, nil
}
