package demo

import (
	"context"
	"fmt"
	"log/slog"
	"path/filepath"
	"time"

	"github.com/kvhost/kvhost/host/bench"
	"github.com/kvhost/kvhost/host/plugin"
)

// memcpyProbeBytes is the working set of the raw memcpy measurement that
// follows a run: larger than the caches, as the workers' pools are.
const memcpyProbeBytes = 64 << 20

// Run runs the demo and returns its summary. The error is for a demo that
// could not run (bad configuration, plugin missing, a worker that did not
// start, ctx ended); failed or unverified requests are in the summary
// (Summary.Success).
func Run(ctx context.Context, cfg Config) (*Summary, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if cfg.Log == nil {
		cfg.Log = slog.Default()
	}
	timeout := cfg.Timeout
	if timeout <= 0 {
		timeout = 10 * time.Minute
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	// Find and open the plugin first: a missing one is an error before
	// anything starts, every process then loads this very file, and the
	// memory kind the pools are registered as may depend on it.
	dirs := plugin.SearchDirs(cfg.PluginPath)
	path, err := plugin.Find(cfg.Plugin, dirs)
	if err != nil {
		return nil, fmt.Errorf("demo: %w", err)
	}
	s := &Summary{Style: cfg.Style, Attention: cfg.Attention, Plugin: cfg.Plugin, PrefillTP: cfg.PrefillTP,
		DecodeTP: cfg.DecodeTP, Requests: cfg.Requests}
	p, err := plugin.Open(path)
	if err != nil {
		return nil, fmt.Errorf("demo: %w", err)
	}
	defer p.Close()
	if cfg.MemKinds, err = memKinds(&cfg, p); err != nil {
		return nil, err
	}
	if err := cfg.kindsErr(); err != nil {
		return nil, err
	}
	s.MemKinds = cfg.MemKinds
	if cfg.InProcess {
		err = runInProcess(ctx, &cfg, p, s)
	} else {
		err = runProcs(ctx, &cfg, filepath.Dir(path), s)
	}
	if err != nil {
		return nil, err
	}
	s.finish()
	block := uint64(max(4096, min(s.BytesPerTransfer, 64<<20)))
	probe := cfg.MemcpyTime
	if probe <= 0 {
		probe = 300 * time.Millisecond
	}
	if s.MemcpyGBps, err = bench.MemcpyRate(block, memcpyProbeBytes, probe); err != nil {
		return s, fmt.Errorf("demo: memcpy baseline: %w", err)
	}
	return s, nil
}
