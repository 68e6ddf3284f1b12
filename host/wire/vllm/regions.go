package vllm

import (
	"fmt"
	"slices"
	"strings"
)

// Bounds of version 11's and 12's per-region metadata (MaxRegionName also
// bounds the names an engine gives the sidecar). vLLM's region
// names are layer names ("model.layers.61.self_attn.attn") and its memory
// types NIXL's ("VRAM", "DRAM", "BLK", "OBJ", "FILE").
const (
	MaxRegionName    = 512
	maxMemTypeName   = 16
	maxRegionBlocks  = 1 << 40
	regionFieldsNote = "index-aligned with kv_caches_base_addr"
)

// checkRegions checks what a decoded NixlAgentMetadata says per region
// against the rest of it, as vLLM's select_remote_regions and
// align_remote_regions_by_layer (nixl/utils.py) assert: each region list
// None or one entry per region, block counts and group ids in range,
// names and memory types non-empty and bounded, no layer in two regions.
// A violation is ErrMalformed naming the field; whether kvhost can map
// a well-formed layout is CheckMappable's.
func (m *AgentMetadata) checkRegions() error {
	n := len(m.KVCachesBaseAddr)
	length := func(field string, l int, present bool) error {
		if present && l != n {
			return malformed("NixlAgentMetadata field %q has %d entries for %d regions (%s)", field, l, n, regionFieldsNote)
		}
		return nil
	}
	for _, c := range []struct {
		field   string
		l       int
		present bool
	}{
		{"region_num_blocks", len(m.RegionNumBlocks), m.RegionNumBlocks != nil},
		{"region_group_ids", len(m.RegionGroupIDs), m.RegionGroupIDs != nil},
		{"region_names", len(m.RegionNames), m.RegionNames != nil},
		{"region_mem_types", len(m.RegionMemTypes), m.RegionMemTypes != nil},
		// Empty: the worker names no members.
		{"region_members", len(m.RegionMembers), len(m.RegionMembers) > 0},
	} {
		if err := length(c.field, c.l, c.present); err != nil {
			return err
		}
	}
	for i, b := range m.RegionNumBlocks {
		if b < 1 || b > maxRegionBlocks {
			return malformed("NixlAgentMetadata region_num_blocks[%d] is %d, want 1..%d", i, b, maxRegionBlocks)
		}
	}
	for i, g := range m.RegionGroupIDs {
		// A group holds at least one region: there are fewer groups than regions.
		if g < 0 || g >= n {
			return malformed("NixlAgentMetadata region_group_ids[%d] is %d, want 0..%d (a group per region at most)", i, g, n-1)
		}
	}
	if err := checkNames("region_names", m.RegionNames, MaxRegionName); err != nil {
		return err
	}
	if err := checkNames("region_mem_types", m.RegionMemTypes, maxMemTypeName); err != nil {
		return err
	}
	seen := make(map[string]int)
	for i, layers := range m.RegionMembers {
		if err := checkNames(fmt.Sprintf("region_members[%d]", i), layers, MaxRegionName); err != nil {
			return err
		}
		for _, l := range layers {
			if j, dup := seen[l]; dup {
				return malformed("NixlAgentMetadata region_members names layer %q in regions %d and %d", truncate([]byte(l)), j, i)
			}
			seen[l] = i
		}
	}
	return nil
}

// checkNames checks each entry of a list of names is non-empty and at most max
// bytes.
func checkNames(field string, v []string, max int) error {
	for i, s := range v {
		if s == "" || len(s) > max {
			return malformed("NixlAgentMetadata %s[%d] is %d bytes, want 1..%d", field, i, len(s), max)
		}
	}
	return nil
}

// ErrRegionLayout marks per-region metadata kvhost cannot map onto its
// one-group, uniform caches.
var ErrRegionLayout = fmt.Errorf("vllm: a region layout kvhost cannot map")

// CheckMappable refuses a region layout kvhost cannot read or serve: it
// maps one KV cache group whose regions each hold num_blocks blocks of one
// layer, in memType (the NIXL memory type of the local cache: the remote
// prefill's regions are prepared as that kind). A None list says nothing
// and passes, as vLLM's add_remote_agent falls back to uniform values for
// a peer that omits them. The error names the field.
func (m *AgentMetadata) CheckMappable(memType string) error {
	refuse := func(format string, args ...any) error {
		return fmt.Errorf("%w: %s", ErrRegionLayout, fmt.Sprintf(format, args...))
	}
	for i, b := range m.RegionNumBlocks {
		if b != m.NumBlocks {
			return refuse("region_num_blocks[%d] is %d, num_blocks %d: kvhost reads regions of num_blocks blocks each", i, b, m.NumBlocks)
		}
	}
	for i, g := range m.RegionGroupIDs {
		if g != 0 {
			return refuse("region_group_ids[%d] is %d: kvhost reads one KV cache group (0), not a hybrid model's several "+
				"(run vLLM with --disable-hybrid-kv-cache-manager)", i, g)
		}
	}
	for i, t := range m.RegionMemTypes {
		if t != memType {
			return refuse("region_mem_types[%d] is %q: kvhost reads regions of its own memory type %q only (region_mem_types %s)",
				i, truncate([]byte(t)), memType, summary(m.RegionMemTypes))
		}
	}
	for i, layers := range m.RegionMembers {
		if len(layers) > 1 {
			return refuse("region_members[%d] pools %d layers in one region: kvhost reads one layer per region", i, len(layers))
		}
	}
	return nil
}

// summary is a short form of a list of names: the distinct ones, in order.
func summary(v []string) string {
	var d []string
	for _, s := range v {
		if !slices.Contains(d, s) {
			d = append(d, string(truncate([]byte(s))))
		}
		if len(d) == 4 {
			d = append(d, "...")
			break
		}
	}
	return "[" + strings.Join(d, " ") + "]"
}

// UniformRegions fills version 11's and 12's region fields as a vLLM
// worker does for a cache of one KV cache group (register_kv_caches): per
// region num_blocks, group 0, its name and memType; region_members empty
// (a pull worker names none). names are the regions' layer names.
func (m *AgentMetadata) UniformRegions(names []string, memType string) {
	n := len(m.KVCachesBaseAddr)
	m.RegionNumBlocks = make([]int, n)
	m.RegionGroupIDs = make([]int, n)
	m.RegionMemTypes = make([]string, n)
	for i := range n {
		m.RegionNumBlocks[i] = m.NumBlocks
		m.RegionMemTypes[i] = memType
	}
	m.RegionNames = slices.Clone(names)
	m.RegionMembers = nil
}
