// Package memkind is the one place where a memory kind crosses between the
// plugin ABI and the planner.
//
// Two types name the same thing on purpose. abi.MemKind is kvp_mem_kind of
// abi/kvplugin.h: its values are part of the C ABI every plugin is built
// against. planner.MemKind is the planner's own, because the planner is
// pure computation that imports nothing of kvhost (DESIGN: arrows point
// cmd -> host -> planner, abi), and making abi import the planner would tie
// the C ABI mirror to the planning code. Both are numbered as NIXL's
// nixl_mem_t (DRAM_SEG 0, VRAM_SEG 1) and named as on SGLang's wire
// ("DRAM", "VRAM"); this package's test fails if they ever drift apart.
// The runtimes (host/push, host/pull) convert only through ToPlanner and
// ToABI.
package memkind

import (
	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/planner"
)

// ToPlanner returns the planner's kind for a plugin's kind.
func ToPlanner(k abi.MemKind) planner.MemKind { return planner.MemKind(k) }

// ToABI returns the plugin's kind for a planner's kind.
func ToABI(k planner.MemKind) abi.MemKind { return abi.MemKind(k) }
