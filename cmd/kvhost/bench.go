package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"

	"github.com/schollz/progressbar/v3"
	"github.com/urfave/cli/v2"
	"golang.org/x/term"

	"github.com/kvhost/kvhost/host/bench"
	"github.com/kvhost/kvhost/host/plugin"
)

func init() { register(benchCommand) }

// benchCommand builds `kvhost bench`.
func benchCommand() *cli.Command {
	return &cli.Command{
		Name:  "bench",
		Usage: "sweep a transfer plugin over block sizes, batches, READ/WRITE, paths and threads, beside this machine's raw copy rate",
		UsageText: "kvhost [--backend NAME] bench [--procs 1,2] [--ops WRITE,READ] [--paths prepped,batch]\n" +
			"    [--blocks 4K..64M] [--batches 1,16] [--threads 1,2] [--sweep num_threads=0,2,4,8]\n" +
			"    [--json | --csv] [--plot FILE.png]",
		Description: "A nixlbench-style sweep of the plugin chosen with --backend. Every combination of the\n" +
			"lists given is a row; one iteration submits a transfer of BATCH descriptors of BLOCK bytes\n" +
			"(contiguous; made and posted in one plugin call) and polls it to completion with the poll\n" +
			"that releases it, per thread. Columns follow nixlbench (and bin/nixl-bench-direct, the\n" +
			"direct-NIXL baseline): block size, batch size, bandwidth (1e9 bytes/s), average latency of\n" +
			"a whole iteration, average and p99 of the prep (the submit call: making and posting the\n" +
			"transfer), post (0: part of the submit), and transfer (submit to completion) times in µs,\n" +
			"and the posting thread's CPU time per iteration (CPU/op).\n\n" +
			"The raw baseline of this machine is measured in the same run: every thread alternates one\n" +
			"transfer with one raw copy of the same blocks between the same buffers, so load from\n" +
			"elsewhere hits both alike: memcpy (Go's copy and libc's memcpy, the faster counts) with both\n" +
			"agents in this process, process_vm_writev/readv with the target agent in a second process\n" +
			"(--procs 2: kvhost re-executed, metadata over a pipe). B/W and Base are medians over\n" +
			"--rounds rounds of bytes over time; Eff. is the median over all iterations of the paired\n" +
			"ratio (the baseline copy's time over the transfer's, microseconds apart), which a hiccup on\n" +
			"a shared machine does not move, so it need not equal B/W over Base. After a row the destination is\n" +
			"cleared, moved once more and checked byte for byte (Verified; in the target process for\n" +
			"--procs 2). Any failed transfer or check fails the run (exit status 1).\n\n" +
			"--sweep runs every row once per combination of the swept initiator agent parameters, each\n" +
			"with an initiator agent of its own, and the table and plot show each combination apart: pick\n" +
			"NIXL's UCX worker threads (num_threads) for this machine with it. NIXL's UCX backend splits\n" +
			"only transfers of at least 1024 descriptors over its threads, counted after NIXL merged\n" +
			"neighbouring ones: contiguous blocks of a prepped row merge into one, so sweep threads with\n" +
			"--scatter, which shuffles the descriptors as an engine's allocator scatters KV pages\n" +
			"(e.g. --blocks 32K --batches 4096 --scatter: a 128 MiB request of 16-token pages).\n\n" +
			"Sizes take K, M, G suffixes (binary); LO..HI is every power of two times LO up to HI.\n" +
			"The progress bar (stderr) shows only on a terminal and never with --json or --csv.",
		Flags: []cli.Flag{
			&cli.StringFlag{Name: "procs", EnvVars: env("BENCH_PROCS"), Value: "1", Usage: "process layouts: 1 (both agents here), 2 (target agent in a second process), or 1,2"},
			&cli.StringFlag{Name: "ops", EnvVars: env("BENCH_OPS"), Value: "WRITE", Usage: "operations: WRITE, READ or WRITE,READ"},
			&cli.StringFlag{Name: "paths", EnvVars: env("BENCH_PATHS"), Value: "prepped", Usage: "transfer paths: prepped (lists prepared once per row, indices per transfer), batch (region + offsets per transfer), or both"},
			&cli.StringFlag{Name: "blocks", EnvVars: env("BENCH_BLOCKS"), Value: "4K..64M", Usage: "block sizes (bytes per descriptor): a comma list of sizes and LO..HI ranges"},
			&cli.StringFlag{Name: "batches", EnvVars: env("BENCH_BATCHES"), Value: "1", Usage: "batch sizes (descriptors per transfer), a comma list"},
			&cli.StringFlag{Name: "threads", EnvVars: env("BENCH_THREADS"), Value: "1", Usage: "goroutines posting at once, each on its own blocks, a comma list"},
			&cli.IntFlag{Name: "warmup", EnvVars: env("BENCH_WARMUP"), Value: 4, Usage: "untimed iterations per thread before each row"},
			&cli.IntFlag{Name: "iters", EnvVars: env("BENCH_ITERS"), Value: 20, Usage: "timed iterations per thread and row, at least"},
			&cli.DurationFlag{Name: "time", EnvVars: env("BENCH_TIME"), Value: bench.Defaults().Time, Usage: "duration per row, at least, transfers and baseline copies together (split over the rounds)"},
			&cli.IntFlag{Name: "rounds", EnvVars: env("BENCH_ROUNDS"), Value: 5, Usage: "rounds per row; rates are medians over rounds"},
			&cli.StringFlag{Name: "max-buffer", EnvVars: env("BENCH_MAX_BUFFER"), Value: "256M", Usage: "skip rows needing more than this per side (block x batch x threads)"},
			&cli.StringSliceFlag{Name: "param", EnvVars: env("BENCH_PARAMS"), Usage: "agent parameter `key=value` for both agents (repeatable), e.g. caps_off=prepped, workers=2; the host adds its per-side defaults (nixl: num_threads=4 on the initiator) for keys not given"},
			&cli.StringSliceFlag{Name: "sweep", EnvVars: env("BENCH_SWEEP"), Usage: "sweep an initiator agent parameter over `key=v1,v2,...` (repeatable: every combination), a fresh initiator agent per combination, e.g. num_threads=0,2,4,8 or num_workers=1,2 (nixl's UCX worker threads and workers)"},
			&cli.BoolFlag{Name: "telemetry", EnvVars: env("BENCH_TELEMETRY"), Usage: "report the plugin's own post and transfer time from its telemetry, which the releasing poll returns (JSON, CSV)"},
			&cli.BoolFlag{Name: "wait", EnvVars: env("BENCH_WAIT"), Usage: "complete transfers through the completion engine (as the workers do) instead of polling back to back (as nixlbench does)"},
			&cli.BoolFlag{Name: "scatter", EnvVars: env("BENCH_SCATTER"), Usage: "post each thread's descriptors in a shuffled order (the same on both sides, every block to its own offset), so that NIXL cannot merge neighbours, as with KV pages an engine scattered"},
			&cli.BoolFlag{Name: "json", EnvVars: env("BENCH_JSON"), Usage: "print the result as JSON (no table, no progress bar)"},
			&cli.BoolFlag{Name: "csv", EnvVars: env("BENCH_CSV"), Usage: "print the rows as CSV (no table, no progress bar)"},
			&cli.StringFlag{Name: "plot", EnvVars: env("BENCH_PLOT"), Usage: "draw bandwidth against block size, baselines dashed, into `FILE` (.png or .svg)"},
			&cli.BoolFlag{Name: "serve-target", Hidden: true, Usage: "serve as the target process of --procs 2"},
		},
		Action: runBench,
	}
}

func runBench(c *cli.Context) error {
	if c.Bool("serve-target") {
		if os.Getenv(bench.TargetEnv) == "" {
			return errors.New("bench: --serve-target is started by bench --procs 2, not by hand")
		}
		return bench.ServeTargetStdio()
	}
	if c.NArg() > 0 {
		return fmt.Errorf("bench: unexpected argument %q", c.Args().First())
	}
	if c.Bool("json") && c.Bool("csv") {
		return errors.New("bench: --json and --csv exclude each other")
	}
	cfg, err := benchConfig(c)
	if err != nil {
		return fmt.Errorf("bench: %w", err)
	}
	if err := cfg.Validate(); err != nil {
		return err
	}
	out := c.App.Writer
	machine := c.Bool("json") || c.Bool("csv")
	var bar *progressbar.ProgressBar
	if !machine && term.IsTerminal(int(os.Stderr.Fd())) {
		bar = progressbar.NewOptions(-1,
			progressbar.OptionSetWriter(os.Stderr),
			progressbar.OptionSetDescription("bench"),
			progressbar.OptionShowCount(),
			progressbar.OptionSetElapsedTime(true),
			progressbar.OptionSetPredictTime(true),
			progressbar.OptionClearOnFinish(),
			progressbar.OptionSetWidth(30),
		)
		cfg.Progress = func(done, total int, label string) {
			bar.ChangeMax(total)
			bar.Describe(label)
			bar.Set(done)
		}
	}
	runner := &bench.Runner{Config: cfg}
	table := bench.NewTableWriter(out)
	if !machine {
		runner.OnRow = func(r bench.Row) {
			if bar != nil {
				bar.Clear()
			}
			table.Row(r)
		}
	}
	ctx, stop := signalContext(c)
	defer stop()
	res, runErr := runner.Run(ctx)
	if bar != nil {
		bar.Finish()
	}
	if res == nil {
		return runErr
	}
	if err := writeBenchResult(c, out, res, machine); err != nil {
		return err
	}
	if file := c.String("plot"); file != "" && len(res.Rows) > 0 {
		if err := bench.Plot(res, file); err != nil {
			return fmt.Errorf("bench: %w", err)
		}
		if !machine {
			fmt.Fprintf(out, "# plot: %s\n", file)
		}
	}
	if errors.Is(runErr, context.Canceled) {
		return errors.New("bench: interrupted")
	}
	return runErr
}

func writeBenchResult(c *cli.Context, out io.Writer, res *bench.Result, machine bool) error {
	switch {
	case c.Bool("json"):
		return bench.WriteJSON(out, res)
	case c.Bool("csv"):
		return bench.WriteCSV(out, res.Rows)
	}
	if !machine {
		return bench.WriteFooter(out, res)
	}
	return nil
}

// benchConfig turns the flags into a bench.Config.
func benchConfig(c *cli.Context) (bench.Config, error) {
	cfg := bench.Defaults()
	cfg.Plugin = c.String(flagBackend)
	cfg.Dirs = plugin.SearchDirs(c.String(flagPluginPath))
	var err error
	if cfg.Procs, err = bench.ParseInts(c.String("procs")); err != nil {
		return cfg, fmt.Errorf("--procs: %w", err)
	}
	if cfg.Ops, err = bench.ParseOps(c.String("ops")); err != nil {
		return cfg, fmt.Errorf("--ops: %w", err)
	}
	if cfg.Paths, err = bench.ParsePaths(c.String("paths")); err != nil {
		return cfg, fmt.Errorf("--paths: %w", err)
	}
	if cfg.Blocks, err = bench.ParseSizes(c.String("blocks")); err != nil {
		return cfg, fmt.Errorf("--blocks: %w", err)
	}
	if cfg.Batches, err = bench.ParseInts(c.String("batches")); err != nil {
		return cfg, fmt.Errorf("--batches: %w", err)
	}
	if cfg.Threads, err = bench.ParseInts(c.String("threads")); err != nil {
		return cfg, fmt.Errorf("--threads: %w", err)
	}
	if cfg.MaxBuffer, err = bench.ParseSize(c.String("max-buffer")); err != nil {
		return cfg, fmt.Errorf("--max-buffer: %w", err)
	}
	if cfg.Params, err = plugin.ParseParams(c.StringSlice("param")); err != nil {
		return cfg, fmt.Errorf("--param: %w", err)
	}
	if cfg.Sweep, err = bench.ParseSweep(c.StringSlice("sweep")); err != nil {
		return cfg, fmt.Errorf("--sweep: %w", err)
	}
	cfg.Warmup, cfg.Iters, cfg.Rounds = c.Int("warmup"), c.Int("iters"), c.Int("rounds")
	cfg.Time = c.Duration("time")
	cfg.Telemetry = c.Bool("telemetry")
	cfg.Wait = c.Bool("wait")
	cfg.Scatter = c.Bool("scatter")
	cfg.TargetCommand = func() (*exec.Cmd, error) {
		exe, err := os.Executable()
		if err != nil {
			return nil, fmt.Errorf("locating this binary: %w", err)
		}
		return exec.Command(exe, "bench", "--serve-target"), nil
	}
	return cfg, nil
}
