package nixltest

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvhost/kvhost/host/plugin"
)

// TestTwoNetnsTCP moves KV between two kvhost workers in two network
// namespaces joined by two veth pairs, over NIXL with UCX's TCP transport, as
// between two hosts without RDMA: an SGLang-style prefill (`kvhost prefill`)
// in one namespace WRITEs every request's pages into a decode (`kvhost
// decode`) in the other, which checks every byte. Each run is repeated
// (UCX 1.22's TCP PUT zcopy crashes the receiving decode in a share of runs,
// see plugins/nixl/README.md; the plugin turns it off), and each run must:
//   - exit 0 on both sides, with every request OK and every byte verified;
//   - have moved at least the KV bytes over the veth pairs (their counters), so
//     the data really crossed the "network" and not shared memory;
//   - show the plugin's log line that it added TCP_PUT_ENABLE=n.
//
// Two transport settings:
//   - tls=tcp: UCX_TLS=tcp (what the README's crash report used);
//   - default: UCX's default transports, the decode also in its own PID and
//     IPC namespaces, so that UCX finds neither cma nor shared memory to the
//     prefill (they check those namespaces) and picks tcp by itself, as it
//     does between two hosts. This is the case the plugin's
//     tcp_put_emulation=auto exists for: nobody set UCX_TLS;
//   - loopback (not run unless named in KVHOST_NIXL_NETNS_MODES): no
//     namespaces, both sides on 127.0.0.1 with UCX_TLS=tcp, the shape of
//     `UCX_TLS=tcp kvhost demo` in which the crash was measured (UCX then
//     uses two TCP rails to the peer, over lo and the host's other
//     interface). Without TCP_PUT_ENABLE=n the decode crashed in this mode
//     and not in the two namespace modes (see plugins/nixl/README.md).
//
// It needs root (ip netns, unshare), iproute2, util-linux, bin/kvhost and the
// nixl plugin built against an installed NIXL, so it runs only when asked,
// and then fails (never skips) when any of that is missing:
//
//	make && make plugin-nixl NIXL_PREFIX=/opt/nixl
//	KVHOST_NIXL_NETNS=1 go test ./plugins/nixl/nixltest -run TwoNetns -v -count=1 -timeout 30m
//
// Optional: KVHOST_NIXL_NETNS_RUNS (runs per setting, default 5),
// _REQUESTS (per run, default 60), _TP (TP size of both sides, default 2:
// one prefill process hosting both ranks, one decode process per rank, as
// `kvhost demo` runs them), _MODES (tls=tcp,default), _AGENT_PARAMS
// (extra --agent-param values for both workers, comma separated, e.g.
// tcp_put_emulation=false to see UCX's crash again).
//
// The addresses, 198.18.77.1/.2 and 198.18.78.1/.2 on two /30s, come from the range reserved
// for network benchmark tests (198.18.0.0/15, RFC 2544) and exist only inside
// the two namespaces the test creates and deletes, which have no other route.
// (Link-local 169.254.0.0/16 would not do: UCX's ucs_netif_get_addr, in
// src/ucs/sys/sock.c, skips IPv4 link-local addresses, so UCX's TCP transport
// would see no usable interface and report the peer unreachable.)
func TestTwoNetnsTCP(t *testing.T) {
	if os.Getenv("KVHOST_NIXL_NETNS") != "1" {
		t.Skip("needs root and an installed NIXL: set KVHOST_NIXL_NETNS=1 to run it (it then fails when anything is missing)")
	}
	requirePlugin(t)
	kvhost := findBin(t, "kvhost")
	if os.Geteuid() != 0 {
		t.Fatalf("KVHOST_NIXL_NETNS=1 needs root (ip netns, unshare); running as uid %d", os.Geteuid())
	}
	for _, tool := range []string{"ip", "unshare"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Fatalf("KVHOST_NIXL_NETNS=1 needs %s: %v", tool, err)
		}
	}
	runs := envInt(t, "KVHOST_NIXL_NETNS_RUNS", 5)
	requests := envInt(t, "KVHOST_NIXL_NETNS_REQUESTS", 60)
	tp := envInt(t, "KVHOST_NIXL_NETNS_TP", 2)
	var extra []string
	if s := os.Getenv("KVHOST_NIXL_NETNS_AGENT_PARAMS"); s != "" {
		extra = strings.Split(s, ",")
	}
	for _, mode := range envWords("KVHOST_NIXL_NETNS_MODES", "tls=tcp,default") {
		t.Run(mode, func(t *testing.T) {
			if mode != "tls=tcp" && mode != "default" && mode != "loopback" {
				t.Fatalf("KVHOST_NIXL_NETNS_MODES: unknown mode %q (tls=tcp, default or loopback)", mode)
			}
			failed := 0
			for i := 0; i < runs; i++ {
				if err := netnsRun(t, kvhost, mode, i, requests, tp, extra); err != nil {
					failed++
					t.Errorf("run %d of %d (%s): %v", i+1, runs, mode, err)
				}
			}
			t.Logf("%s: %d of %d runs failed (%d requests each)", mode, failed, runs, requests)
		})
	}
}

// netnsRun runs one prefill/decode pair in two fresh namespaces (in the
// loopback mode, here on 127.0.0.1).
func netnsRun(t *testing.T, kvhost, mode string, run, requests, tp int, extra []string) error {
	t.Helper()
	loopback := mode == "loopback"
	tag := fmt.Sprintf("kvh%d", os.Getpid()%100000)
	nsP, nsD := tag+"p", tag+"d"
	addrP, addrD := "198.18.77.1", "198.18.77.2"
	var vethsP []string
	if loopback {
		addrP, addrD = "127.0.0.1", "127.0.0.1"
	} else {
		vethsP = netnsSetup(t, tag, nsP, nsD)
		defer func() {
			// Deleting a namespace deletes its ends of the veth pairs.
			for _, ns := range []string{nsP, nsD} {
				if out, err := exec.Command("ip", "netns", "del", ns).CombinedOutput(); err != nil {
					t.Errorf("cleanup: ip netns del %s: %v: %s", ns, err, out)
				}
			}
		}()
	}
	// inNS runs a command in namespace ns, or here in the loopback mode.
	inNS := func(ctx context.Context, ns string, args ...string) *exec.Cmd {
		if loopback {
			return exec.CommandContext(ctx, args[0], args[1:]...)
		}
		return exec.CommandContext(ctx, "ip", append([]string{"netns", "exec", ns}, args...)...)
	}

	dir := t.TempDir()
	env := []string{
		"PATH=" + os.Getenv("PATH"),
		"HOME=" + os.Getenv("HOME"),
		// WARN shows NIXL's warnings and the plugin's own line about
		// TCP_PUT_ENABLE, which the run checks for.
		"NIXL_LOG_LEVEL=WARN",
	}
	for _, kv := range os.Environ() {
		// A NIXL or UCX built without a RUNPATH needs LD_LIBRARY_PATH.
		if strings.HasPrefix(kv, "LD_LIBRARY_PATH=") || strings.HasPrefix(kv, "NIXL_PLUGIN_DIR=") {
			env = append(env, kv)
		}
	}
	if mode == "tls=tcp" || loopback {
		env = append(env, "UCX_TLS=tcp")
	}
	// The workload of `kvhost demo` (16 layers), where the crash was seen.
	common := []string{"--mem-kinds", "dram", "--layers", "16", "--requests", strconv.Itoa(requests),
		"--seed", strconv.Itoa(run + 1)}
	for _, p := range extra {
		common = append(common, "--agent-param", p)
	}
	addrFile := filepath.Join(dir, "bootstrap-addr")
	pSum := filepath.Join(dir, "prefill.json")
	tpArg := []string{"--tp-size", strconv.Itoa(tp)}

	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	var pErr bytes.Buffer
	prefill := inNS(ctx, nsP, append(append([]string{kvhost, "--backend", "nixl",
		"prefill", "--host", addrP, "--bootstrap-port", "0", "--bootstrap-addr-file", addrFile,
		"--summary", pSum, "--linger", "2s"}, tpArg...), common...)...)
	prefill.Env, prefill.Stderr = env, &pErr
	if err := prefill.Start(); err != nil {
		t.Fatalf("starting prefill: %v", err)
	}
	pDone := make(chan error, 1)
	go func() { pDone <- prefill.Wait() }()
	bootstrap, err := waitFile(ctx, addrFile, pDone)
	if err != nil {
		cancel()
		<-pDone
		return fmt.Errorf("prefill did not serve its bootstrap address: %v\nprefill stderr:\n%s", err, tail(pErr.Bytes()))
	}

	// One decode process per TP rank, as `kvhost demo` runs them. In the
	// default mode each is also in its own PID and IPC namespaces (a new
	// /proc to match), so UCX's cma and shared-memory transports cannot
	// reach the prefill and it picks tcp.
	type dproc struct {
		cmd    *exec.Cmd
		stderr bytes.Buffer
		sum    string
		done   chan error
	}
	ds := make([]*dproc, tp)
	for r := range ds {
		d := &dproc{sum: filepath.Join(dir, fmt.Sprintf("decode-%d.json", r)), done: make(chan error, 1)}
		var args []string
		if mode == "default" {
			args = append(args, "unshare", "--pid", "--ipc", "--mount-proc", "--fork", "--kill-child")
		}
		args = append(args, kvhost, "--backend", "nixl", "decode", "--host", addrD, "--bootstrap-addr", bootstrap,
			"--summary", d.sum, "--tp-ranks", strconv.Itoa(r))
		args = append(append(args, tpArg...), common...)
		d.cmd = inNS(ctx, nsD, args...)
		d.cmd.Env, d.cmd.Stderr = env, &d.stderr
		if err := d.cmd.Start(); err != nil {
			t.Fatalf("starting decode %d: %v", r, err)
		}
		go func() { d.done <- d.cmd.Wait() }()
		ds[r] = d
	}
	var failures []string
	for r, d := range ds {
		if err := <-d.done; err != nil {
			failures = append(failures, fmt.Sprintf("decode %d: %v\ndecode %d stderr:\n%s", r, err,
				r, tail(d.stderr.Bytes())))
			cancel() // the others and the prefill would wait for it
		}
	}
	if err := <-pDone; err != nil {
		failures = append(failures, fmt.Sprintf("prefill: %v\nprefill stderr:\n%s", err, tail(pErr.Bytes())))
	}
	if len(failures) > 0 {
		return fmt.Errorf("%s", strings.Join(failures, "\n"))
	}

	var bytesOK uint64
	for r, d := range ds {
		var sum struct {
			Checked      bool   `json:"checked"`
			Requests     int    `json:"requests"`
			OK           int    `json:"ok"`
			VerifyErrors int    `json:"verify_errors"`
			Bytes        uint64 `json:"bytes"`
		}
		b, err := os.ReadFile(d.sum)
		if err != nil {
			return fmt.Errorf("decode %d summary: %v", r, err)
		}
		if err := json.Unmarshal(b, &sum); err != nil {
			return fmt.Errorf("decode %d summary %s: %v", r, b, err)
		}
		if !sum.Checked || sum.OK != requests || sum.Requests != requests || sum.VerifyErrors != 0 || sum.Bytes == 0 {
			return fmt.Errorf("decode %d summary: want %d requests OK, every byte checked; got %s", r, requests, b)
		}
		bytesOK += sum.Bytes
		if !bytes.Contains(d.stderr.Bytes(), []byte("TCP_PUT_ENABLE=n")) && len(extra) == 0 {
			return fmt.Errorf("decode %d: no log line saying the plugin added TCP_PUT_ENABLE=n; stderr:\n%s", r, tail(d.stderr.Bytes()))
		}
	}
	if !bytes.Contains(pErr.Bytes(), []byte("TCP_PUT_ENABLE=n")) && len(extra) == 0 {
		return fmt.Errorf("prefill: no log line saying the plugin added TCP_PUT_ENABLE=n; stderr:\n%s", tail(pErr.Bytes()))
	}
	// The veth counters: what the prefill's ends sent carried the KV.
	var sent uint64
	for _, v := range vethsP {
		n, err := vethTxBytes(nsP, v)
		if err != nil {
			return err
		}
		sent += n
	}
	if !loopback && sent < bytesOK {
		return fmt.Errorf("the veth pairs carried %d bytes from the prefill, less than the %d KV bytes decode verified: "+
			"the data went another way", sent, bytesOK)
	}
	where := fmt.Sprintf("%d bytes over the veth pairs", sent)
	if loopback {
		where = "over loopback"
	}
	t.Logf("run %d (%s): %d requests, TP %d, %d KV bytes verified, %s", run+1, mode, requests, tp, bytesOK, where)
	return nil
}

// requirePlugin fails (not skips) when the nixl plugin was not built: the
// tests that call it run only when asked to.
func requirePlugin(t *testing.T) {
	t.Helper()
	for _, d := range plugin.SearchDirs("") {
		if _, err := os.Stat(filepath.Join(d, "libkvhost_"+pluginName+".so")); err == nil {
			return
		}
	}
	t.Fatalf("libkvhost_nixl.so not found in %v: build it with `make plugin-nixl NIXL_PREFIX=...` (needs an installed NIXL)", plugin.SearchDirs(""))
}

// findBin locates bin/NAME in the build tree.
func findBin(t *testing.T, name string) string {
	t.Helper()
	dir, _ := os.Getwd()
	for d := dir; ; d = filepath.Dir(d) {
		p := filepath.Join(d, "bin", name)
		if _, err := os.Stat(p); err == nil {
			return p
		}
		if filepath.Dir(d) == d {
			t.Fatalf("bin/%s not found above %s: make builds it", name, dir)
		}
	}
}

// waitFile waits for the prefill to write its bootstrap address.
func waitFile(ctx context.Context, path string, exited <-chan error) (string, error) {
	for {
		if b, err := os.ReadFile(path); err == nil && len(bytes.TrimSpace(b)) > 0 {
			return string(bytes.TrimSpace(b)), nil
		}
		select {
		case err := <-exited:
			return "", fmt.Errorf("prefill exited: %v", err)
		case <-ctx.Done():
			return "", ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// vethTxBytes reads the transmit counter of dev inside namespace ns.
func vethTxBytes(ns, dev string) (uint64, error) {
	out, err := exec.Command("ip", "netns", "exec", ns, "cat", "/sys/class/net/"+dev+"/statistics/tx_bytes").Output()
	if err != nil {
		return 0, fmt.Errorf("tx_bytes of %s in %s: %v", dev, ns, err)
	}
	return strconv.ParseUint(strings.TrimSpace(string(out)), 10, 64)
}

// tail returns the last lines of a process's output, enough to show a
// crash's backtrace.
func tail(b []byte) string {
	const max = 6000
	if len(b) > max {
		b = b[len(b)-max:]
	}
	return string(b)
}

func envInt(t *testing.T, key string, def int) int {
	t.Helper()
	s := os.Getenv(key)
	if s == "" {
		return def
	}
	v, err := strconv.Atoi(s)
	if err != nil || v <= 0 {
		t.Fatalf("%s=%q: want a positive integer", key, s)
	}
	return v
}

// netnsSetup makes namespaces nsP and nsD joined by two veth pairs, two
// addresses each side: UCX then moves RMA over two TCP rails (NIXL asks
// for MAX_RMA_RAILS=2), as between hosts with two NICs. It returns the
// prefill's ends.
func netnsSetup(t *testing.T, tag, nsP, nsD string) []string {
	t.Helper()
	// Leftovers of a killed run of this process id would make `add` fail.
	exec.Command("ip", "netns", "del", nsP).Run()
	exec.Command("ip", "netns", "del", nsD).Run()
	setup := [][]string{
		{"netns", "add", nsP},
		{"netns", "add", nsD},
		{"-n", nsP, "link", "set", "lo", "up"},
		{"-n", nsD, "link", "set", "lo", "up"},
	}
	var vethsP []string
	for i, net := range []string{"198.18.77", "198.18.78"} {
		vp, vd := fmt.Sprintf("%sa%d", tag, i), fmt.Sprintf("%sb%d", tag, i)
		vethsP = append(vethsP, vp)
		setup = append(setup,
			[]string{"link", "add", vp, "type", "veth", "peer", "name", vd},
			[]string{"link", "set", vp, "netns", nsP},
			[]string{"link", "set", vd, "netns", nsD},
			[]string{"-n", nsP, "addr", "add", net + ".1/30", "dev", vp},
			[]string{"-n", nsD, "addr", "add", net + ".2/30", "dev", vd},
			[]string{"-n", nsP, "link", "set", vp, "up"},
			[]string{"-n", nsD, "link", "set", vd, "up"})
	}
	for _, args := range setup {
		if out, err := exec.Command("ip", args...).CombinedOutput(); err != nil {
			exec.Command("ip", "netns", "del", nsP).Run()
			exec.Command("ip", "netns", "del", nsD).Run()
			t.Fatalf("ip %s: %v: %s", strings.Join(args, " "), err, out) // the set-up, not UCX: stop
		}
	}
	return vethsP
}
