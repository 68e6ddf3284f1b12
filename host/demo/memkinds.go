package demo

import (
	"errors"
	"fmt"
	"os"
	"syscall"
	"unsafe"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/host/plugin"
)

// memKinds returns the memory kind the workers register their KV pools as:
// cfg.MemKinds when set, else what probeVRAM finds.
func memKinds(cfg *Config, p *plugin.Plugin) (string, error) {
	if cfg.MemKinds != "" {
		return cfg.MemKinds, nil
	}
	ok, err := probeVRAM(p, cfg.AgentParams)
	if err != nil {
		return "", err
	}
	if ok {
		return "vram", nil
	}
	cfg.kindsWhy = fmt.Sprintf(" (plugin %s does not register the demo's host memory as VRAM)", p.Info().Name)
	cfg.Log.Info("demo: the plugin does not register host memory as VRAM; the workers register their KV pools as DRAM",
		"plugin", p.Info().Name)
	return "dram", nil
}

// probeVRAM creates an agent with the demo's agent parameters and reports
// whether it registers a page of host memory as VRAM. The demo's pools are
// host memory: the fake plugin accepts them as VRAM (it models GPU pools
// with host memory), a real backend checks the memory's type (NIXL's UCX
// refuses host memory as VRAM, and without CUDA any VRAM) with
// ERR_BACKEND or ERR_NOT_SUPPORTED. Any other failure (bad agent parameters,
// a plugin that cannot create agents) is returned: the workers would fail
// the same way, and this says so before any of them starts.
func probeVRAM(p *plugin.Plugin, agentParams []string) (bool, error) {
	params, err := plugin.ParseParams(agentParams)
	if err != nil {
		return false, fmt.Errorf("demo: agent parameters: %w", err)
	}
	a, err := p.NewAgent(fmt.Sprintf("kvhost-demo-probe-%d", os.Getpid()), params...)
	if err != nil {
		return false, fmt.Errorf("demo: creating a probe agent: %w", err)
	}
	defer a.Close()
	page := os.Getpagesize()
	mem, err := syscall.Mmap(-1, 0, page, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_ANON|syscall.MAP_PRIVATE)
	if err != nil {
		return false, fmt.Errorf("demo: probe memory: %w", err)
	}
	defer syscall.Munmap(mem)
	regions, err := a.Register([]abi.MemDesc{{Addr: uint64(uintptr(unsafe.Pointer(&mem[0]))), Len: uint64(page), MemKind: abi.VRAM}})
	switch {
	case err == nil:
		return true, a.Deregister(regions...)
	case errors.Is(err, plugin.ErrBackend), errors.Is(err, plugin.ErrNotSupported):
		return false, nil
	default:
		return false, fmt.Errorf("demo: probe registration: %w", err)
	}
}
