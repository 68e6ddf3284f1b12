package plugin

import "strconv"

// Side is an agent's part in the bulk KV transfers: the side that posts
// them or the side whose memory they read or write.
type Side int

const (
	// Target: peers read or write its memory and it posts nothing large
	// (SGLang's decode, vLLM's prefill).
	Target Side = iota
	// Initiator: it posts the bulk transfers (SGLang's prefill writes,
	// vLLM's decode reads).
	Initiator
)

func (s Side) String() string {
	switch s {
	case Target:
		return "target"
	case Initiator:
		return "initiator"
	}
	return "side(" + strconv.Itoa(int(s)) + ")"
}

// ThreadsParam is the agent parameter that gives a plugin's backend worker
// threads for large transfers: NIXL's UCX backend splits a transfer of at
// least split_batch_size (1024) descriptors over that many threads, each
// with its own UCX worker.
const ThreadsParam = "num_threads"

// InitiatorThreads is the host's ThreadsParam for an initiator whose plugin
// documents it. Both reference connectors give the initiator UCX worker
// threads (SGLang's prefill 8, vLLM 4) and the target none; on the 2-core
// machine measured (plugins/nixl/README.md, "Worker threads") 2, 4 and 8
// moved 128 MiB requests alike, 2.2-2.4 times NIXL's default of none, so
// the host takes vLLM's 4: each thread costs UCX resources (UARs on
// Mellanox NICs, which NVSHMEM and DeepEP need too), so no more than that.
const InitiatorThreads = 4

// PrefaultParam is the agent parameter that has a plugin touch the DRAM
// it registers before any transfer does (the nixl and fake plugins: "The
// first request to a peer" in plugins/nixl/README.md, "The kernel's first
// touch" in plugins/fake/README.md). The pass pays, at registration, the
// first access to each page through this process's own addresses, which a
// copy made by this process otherwise pays inside its first transfers
// (about 4.6 us a page on the PVM guests measured: 1.2-1.3 s per GiB).
//
// Only the side whose own process copies needs it: the initiator, whose
// process_vm_* (UCX cma) or memcpy reaches its local pages through its
// own addresses. A target's memory is reached from other processes, by
// the kernel through the peer's process_vm_* (which costs the target's
// addresses nothing) or through the peer's own mapping, which the peer
// warms. So the host passes prefault=false to targets: a sidecar whose
// ranks only receive registers its pool at once instead of at about a
// second per GiB. Agents whose peers live in the same process (kvhost demo
// --in-process, where the initiator's copies touch the target's pages
// through this process's addresses) keep the pass: WithLocalPeers.
const PrefaultParam = "prefault"

// sideDefault is a host default for one agent parameter, per side; an
// empty value passes nothing (the plugin's own default).
type sideDefault struct {
	key               string
	initiator, target string
}

var sideDefaults = []sideDefault{
	{key: ThreadsParam, initiator: strconv.Itoa(InitiatorThreads)},
	{key: PrefaultParam, target: "false"},
}

// ForSide returns params completed with the host's defaults for an agent
// on side: each default whose key the plugin documents (Info().HasParam,
// so a plugin that refuses unknown keys never sees one) and params do not
// set. The caller's params come first and are not modified; a key the
// caller sets, to any value, keeps the caller's value.
func (p *Plugin) ForSide(side Side, params []Param) []Param {
	out := append([]Param(nil), params...)
	for _, d := range sideDefaults {
		v := d.target
		if side == Initiator {
			v = d.initiator
		}
		if v == "" || !p.info.HasParam(d.key) || hasKey(params, d.key) {
			continue
		}
		out = append(out, Param{Key: d.key, Value: v})
	}
	return out
}

// WithLocalPeers returns params completed for agents whose peers are in
// this process: prefault=true where the plugin documents it and params
// do not set it, so that ForSide's target default (see PrefaultParam)
// does not apply to a target whose initiator copies into its pages from
// this process. The caller's params come first and are not modified.
func (p *Plugin) WithLocalPeers(params []Param) []Param {
	out := append([]Param(nil), params...)
	if p.info.HasParam(PrefaultParam) && !hasKey(params, PrefaultParam) {
		out = append(out, Param{Key: PrefaultParam, Value: "true"})
	}
	return out
}

// MergeParams returns base with every key of over set to over's value:
// keys of base that over sets take over's value in place, over's other
// keys follow in order. Neither slice is modified. The last of repeated
// keys in over wins.
func MergeParams(base, over []Param) []Param {
	out := append([]Param(nil), base...)
	for _, kv := range over {
		replaced := false
		for i := range out {
			if out[i].Key == kv.Key {
				out[i].Value, replaced = kv.Value, true
			}
		}
		if !replaced {
			out = append(out, kv)
		}
	}
	return out
}

func hasKey(params []Param, key string) bool {
	for _, kv := range params {
		if kv.Key == key {
			return true
		}
	}
	return false
}
