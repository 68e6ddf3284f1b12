package bench

import (
	"errors"
	"fmt"
	"math/bits"
	"os/exec"
	"strconv"
	"strings"
	"time"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/host/plugin"
)

// Path is how a transfer is described to the plugin.
type Path string

const (
	// Prepped: descriptor lists prepared once per row (PrepLocal,
	// PrepRemote); each transfer names descriptors by index
	// (MakePreppedXfer). NIXL's prepXferDlist + makeXferReq.
	Prepped Path = "prepped"
	// Batch: each transfer carries region-relative entries against a
	// remote region imported once (MakeBatchXfer). MORI-IO's BatchWrite.
	Batch Path = "batch"
)

// Config is one sweep: every combination of Procs x Ops x Paths x Threads x
// Blocks x Batches whose buffer fits MaxBuffer is a row.
type Config struct {
	Plugin string         // plugin name, e.g. "fake"
	Dirs   []string       // plugin search folders (plugin.SearchDirs)
	Params []plugin.Param // agent parameters, for both agents

	Procs   []int // 1: both agents here; 2: target agent in a second process
	Ops     []abi.Op
	Paths   []Path
	Threads []int    // goroutines posting at once, each on its own blocks
	Blocks  []uint64 // bytes per descriptor
	Batches []int    // descriptors per transfer

	// MaxBuffer caps block*batch*threads, the bytes each side needs for a
	// row; larger rows are skipped (and listed in Result.Skipped).
	MaxBuffer uint64
	// Warmup iterations per thread before a row is timed (subject and
	// baseline alike).
	Warmup int
	// A row runs at least Iters iterations per thread and at least Time,
	// split over Rounds rounds of subject then baseline (alternating).
	Iters  int
	Time   time.Duration
	Rounds int
	// Telemetry reports the plugin's own post and transfer time beside the
	// host's (the telemetry the poll that releases a transfer returns: no
	// extra plugin call on a plugin with CapSubmit).
	Telemetry bool
	// Wait completes each transfer through the agent's completion engine
	// (plugin.Engine.Finish: a moment of polling, then the engine, as the
	// runtimes do) instead of polling back to back (as nixlbench does).
	Wait bool
	// Scatter posts each thread's descriptors in a shuffled order, the same
	// on both sides: every block still moves to its own offset, but no two
	// descriptors in a row are neighbours in memory, as the pages of a KV
	// cache an engine's allocator scattered. NIXL merges runs of adjacent
	// descriptors (makeXferReq), so without it a prepped row of contiguous
	// blocks moves as one descriptor, which NIXL's UCX worker threads never
	// split (split_batch_size counts merged descriptors).
	Scatter bool

	// Sweep varies the initiator agent's parameters: every combination of
	// the values of its keys is a variant, and every row runs once per
	// variant, with an initiator agent of its own created with Params, the
	// variant's values over them, and the host's initiator defaults for
	// keys neither sets (plugin.ForSide). The target agent gets Params and
	// the host's target defaults, the same in every variant. E.g.
	// num_threads=0,2,4,8 (NIXL's UCX worker threads) picks the count for
	// this machine.
	Sweep []ParamSweep

	// TargetCommand makes the command of the target process for Procs 2
	// (not started; stdin, stdout and stderr are set by the bench). The
	// process must call ServeTargetStdio. Required when Procs has 2.
	TargetCommand func() (*exec.Cmd, error)

	// Progress, when set, is called after every round of every row with
	// the number of rounds done and the total, and a short label of the
	// row being run. Called from the goroutine that called Run.
	Progress func(done, total int, label string)
}

// DefaultBlocks are the block sizes swept when none are given: 4 KiB to
// 64 MiB, powers of two.
func DefaultBlocks() []uint64 {
	var out []uint64
	for b := uint64(4 << 10); b <= 64<<20; b *= 2 {
		out = append(out, b)
	}
	return out
}

// Defaults returns a Config with the default sweep (fake plugin, same
// process, WRITE, prepped, 1 thread, batch 1, 4 KiB..64 MiB).
func Defaults() Config {
	return Config{
		Plugin:    "fake",
		Procs:     []int{1},
		Ops:       []abi.Op{abi.Write},
		Paths:     []Path{Prepped},
		Threads:   []int{1},
		Blocks:    DefaultBlocks(),
		Batches:   []int{1},
		MaxBuffer: 256 << 20,
		Warmup:    4,
		Iters:     20,
		Time:      200 * time.Millisecond,
		Rounds:    5,
	}
}

// Validate checks the configuration and returns the first problem found.
func (c *Config) Validate() error {
	switch {
	case c.Plugin == "":
		return errors.New("bench: no plugin")
	case len(c.Procs) == 0 || len(c.Ops) == 0 || len(c.Paths) == 0 || len(c.Threads) == 0 ||
		len(c.Blocks) == 0 || len(c.Batches) == 0:
		return errors.New("bench: empty sweep (procs, ops, paths, threads, blocks and batches all need a value)")
	case c.Rounds < 1:
		return fmt.Errorf("bench: rounds must be at least 1, got %d", c.Rounds)
	case c.Iters < 1:
		return fmt.Errorf("bench: iterations must be at least 1, got %d", c.Iters)
	case c.Warmup < 0:
		return fmt.Errorf("bench: warm-up must not be negative, got %d", c.Warmup)
	case c.Time < 0:
		return fmt.Errorf("bench: time must not be negative, got %v", c.Time)
	}
	for _, p := range c.Procs {
		if p != 1 && p != 2 {
			return fmt.Errorf("bench: procs must be 1 or 2, got %d", p)
		}
		if p == 2 && c.TargetCommand == nil {
			return errors.New("bench: two-process rows need a TargetCommand")
		}
	}
	for _, p := range c.Paths {
		if p != Prepped && p != Batch {
			return fmt.Errorf("bench: unknown path %q (want prepped or batch)", p)
		}
	}
	for _, t := range c.Threads {
		if t < 1 || t > 1024 {
			return fmt.Errorf("bench: threads must be 1..1024, got %d", t)
		}
	}
	for _, b := range c.Batches {
		if b < 1 || b > 1<<20 {
			return fmt.Errorf("bench: batch size must be 1..1048576, got %d", b)
		}
	}
	for _, b := range c.Blocks {
		if b == 0 {
			return errors.New("bench: block size must be at least 1 byte")
		}
	}
	if err := checkSweep(c.Sweep); err != nil {
		return err
	}
	if c.bufferSize() == 0 {
		return fmt.Errorf("bench: every row needs more than --max-buffer (%s) per side", FormatSize(c.MaxBuffer))
	}
	return nil
}

// ParamSweep is one swept agent parameter: its key and the values tried.
type ParamSweep struct {
	Key    string
	Values []string
}

// maxVariants bounds the combinations of a sweep: each is a whole sweep of
// the other lists.
const maxVariants = 64

func checkSweep(sw []ParamSweep) error {
	n := 1
	seen := map[string]bool{}
	for _, s := range sw {
		if s.Key == "" || len(s.Values) == 0 {
			return fmt.Errorf("bench: swept parameter %q needs a key and at least one value", s.Key)
		}
		if seen[s.Key] {
			return fmt.Errorf("bench: parameter %q swept twice", s.Key)
		}
		seen[s.Key] = true
		if n *= len(s.Values); n > maxVariants {
			return fmt.Errorf("bench: the sweep has more than %d combinations", maxVariants)
		}
	}
	return nil
}

// variants returns every combination of the sweep's values, the first key
// varying slowest; one empty variant without a sweep.
func variants(sw []ParamSweep) [][]plugin.Param {
	out := [][]plugin.Param{nil}
	for _, s := range sw {
		var next [][]plugin.Param
		for _, v := range out {
			for _, val := range s.Values {
				next = append(next, append(append([]plugin.Param(nil), v...), plugin.Param{Key: s.Key, Value: val}))
			}
		}
		out = next
	}
	return out
}

// ParseSweep parses "key=v1,v2,..." strings (as given to --sweep; a string
// without "=" continues the previous list, as the CLI splits flags on
// commas) into swept parameters.
func ParseSweep(kvs []string) ([]ParamSweep, error) {
	params, err := plugin.ParseParams(kvs)
	if err != nil {
		return nil, err
	}
	var out []ParamSweep
	for _, p := range params {
		vals := splitList(p.Value)
		if len(vals) == 0 {
			return nil, fmt.Errorf("swept parameter %q has no value", p.Key)
		}
		out = append(out, ParamSweep{Key: p.Key, Values: vals})
	}
	return out, nil
}

// rowBytes is what a row needs on each side, or 0 on overflow.
func rowBytes(block uint64, batch, threads int) uint64 {
	hi, n := bits.Mul64(block, uint64(batch)*uint64(threads))
	if hi != 0 {
		return 0
	}
	return n
}

// bufferSize is the largest row that fits MaxBuffer (0: none fits).
func (c *Config) bufferSize() uint64 {
	var need uint64
	for _, b := range c.Blocks {
		for _, n := range c.Batches {
			for _, t := range c.Threads {
				if r := rowBytes(b, n, t); r != 0 && r <= c.MaxBuffer {
					need = max(need, r)
				}
			}
		}
	}
	return need
}

// ParseOps parses a comma list of READ and WRITE (any case).
func ParseOps(s string) ([]abi.Op, error) {
	var out []abi.Op
	for _, f := range splitList(s) {
		switch strings.ToUpper(f) {
		case "WRITE":
			out = append(out, abi.Write)
		case "READ":
			out = append(out, abi.Read)
		default:
			return nil, fmt.Errorf("unknown operation %q (want READ or WRITE)", f)
		}
	}
	if len(out) == 0 {
		return nil, errors.New("no operation given")
	}
	return out, nil
}

// ParsePaths parses a comma list of prepped and batch.
func ParsePaths(s string) ([]Path, error) {
	var out []Path
	for _, f := range splitList(s) {
		p := Path(strings.ToLower(f))
		if p != Prepped && p != Batch {
			return nil, fmt.Errorf("unknown path %q (want prepped or batch)", f)
		}
		out = append(out, p)
	}
	if len(out) == 0 {
		return nil, errors.New("no path given")
	}
	return out, nil
}

// ParseInts parses a comma list of positive integers.
func ParseInts(s string) ([]int, error) {
	var out []int
	for _, f := range splitList(s) {
		n, err := strconv.Atoi(f)
		if err != nil || n < 1 {
			return nil, fmt.Errorf("bad count %q (want a positive integer)", f)
		}
		out = append(out, n)
	}
	if len(out) == 0 {
		return nil, errors.New("no value given")
	}
	return out, nil
}

// ParseSizes parses a comma list of sizes ("4096", "4K", "4KiB", "1M",
// "2G") and ranges "LO..HI", which expand to the powers of two times LO up
// to HI ("4K..64M" is 4K, 8K, ..., 64M).
func ParseSizes(s string) ([]uint64, error) {
	var out []uint64
	for _, f := range splitList(s) {
		lo, hi, isRange := strings.Cut(f, "..")
		a, err := ParseSize(lo)
		if err != nil {
			return nil, err
		}
		if !isRange {
			out = append(out, a)
			continue
		}
		b, err := ParseSize(hi)
		if err != nil {
			return nil, err
		}
		if b < a {
			return nil, fmt.Errorf("size range %q runs backwards", f)
		}
		for v := a; v <= b; v *= 2 {
			out = append(out, v)
			if v > b/2 {
				break
			}
		}
	}
	if len(out) == 0 {
		return nil, errors.New("no size given")
	}
	return out, nil
}

// ParseSize parses one size: a number of bytes with an optional binary
// suffix K, M, G (or KiB, MiB, GiB; any case).
func ParseSize(s string) (uint64, error) {
	t := strings.TrimSpace(s)
	mult := uint64(1)
	u := strings.ToUpper(t)
	for _, suf := range []struct {
		s string
		m uint64
	}{{"KIB", 1 << 10}, {"MIB", 1 << 20}, {"GIB", 1 << 30}, {"K", 1 << 10}, {"M", 1 << 20}, {"G", 1 << 30}, {"B", 1}} {
		if strings.HasSuffix(u, suf.s) {
			mult = suf.m
			t = t[:len(t)-len(suf.s)]
			break
		}
	}
	n, err := strconv.ParseUint(strings.TrimSpace(t), 10, 64)
	if err != nil || n == 0 {
		return 0, fmt.Errorf("bad size %q (want e.g. 4096, 64K, 1M)", s)
	}
	hi, v := bits.Mul64(n, mult)
	if hi != 0 {
		return 0, fmt.Errorf("size %q too large", s)
	}
	return v, nil
}

// FormatSize prints a byte count the short way: 4K, 1M, 64M, 1536 (exact
// values only; anything else in bytes).
func FormatSize(n uint64) string {
	switch {
	case n >= 1<<30 && n%(1<<30) == 0:
		return strconv.FormatUint(n>>30, 10) + "G"
	case n >= 1<<20 && n%(1<<20) == 0:
		return strconv.FormatUint(n>>20, 10) + "M"
	case n >= 1<<10 && n%(1<<10) == 0:
		return strconv.FormatUint(n>>10, 10) + "K"
	}
	return strconv.FormatUint(n, 10)
}

func splitList(s string) []string {
	var out []string
	for _, f := range strings.Split(s, ",") {
		if f = strings.TrimSpace(f); f != "" {
			out = append(out, f)
		}
	}
	return out
}
