package pullworker

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"os/signal"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kvhost/kvhost/host/plugin"
)

// The two-process tests run the prefill (and sometimes a second decode) as
// children: this test binary re-executed with childEnv naming the role and
// specEnv holding its configuration. The decode under test runs in the
// test process, so the fake plugin moves bytes across processes with
// process_vm_readv and delivers notifications over its socket.
const (
	childEnv = "KVHOST_PULL_DEMO_CHILD"
	specEnv  = "KVHOST_PULL_DEMO_SPEC"
)

type childSpec struct {
	Model        Model
	Engine       Engine
	EngineID     string
	AbortTimeout time.Duration
	Workload     Workload
	AgentParams  []string
	// decode child only
	Ranks      []int
	PrefillURL string
}

func TestMain(m *testing.M) {
	switch os.Getenv(childEnv) {
	case "":
		os.Exit(m.Run())
	case "prefill":
		os.Exit(runChild(childPrefill))
	case "decode":
		os.Exit(runChild(childDecode))
	default:
		fmt.Fprintln(os.Stderr, "unknown child role", os.Getenv(childEnv))
		os.Exit(2)
	}
}

func runChild(f func(context.Context, childSpec, *plugin.Plugin, *slog.Logger) error) int {
	var spec childSpec
	if err := json.Unmarshal([]byte(os.Getenv(specEnv)), &spec); err != nil {
		fmt.Fprintln(os.Stderr, "child spec:", err)
		return 2
	}
	p, err := plugin.Load("fake", plugin.SearchDirs(""))
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	level := slog.LevelWarn
	if os.Getenv("KVHOST_TEST_LOG") != "" {
		level = slog.LevelDebug
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: level}))
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	ctx, cancel := context.WithTimeout(ctx, 2*time.Minute) // never outlive a stuck test
	defer cancel()
	if err := f(ctx, spec, p, log); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	return 0
}

func childPrefill(ctx context.Context, s childSpec, p *plugin.Plugin, log *slog.Logger) error {
	params, err := plugin.ParseParams(s.AgentParams)
	if err != nil {
		return err
	}
	pf, err := StartPrefill(PrefillConfig{Plugin: p, AgentParams: params, Model: s.Model, Engine: s.Engine, EngineID: s.EngineID,
		SideChannel: "tcp://127.0.0.1:0", APIAddr: "127.0.0.1:0", AbortTimeout: s.AbortTimeout, Workload: s.Workload, Logger: log})
	if err != nil {
		return err
	}
	defer pf.Close()
	json.NewEncoder(os.Stdout).Encode(map[string]string{"api": pf.APIAddr()})
	sum := pf.Wait(ctx)
	return json.NewEncoder(os.Stdout).Encode(sum)
}

func childDecode(ctx context.Context, s childSpec, p *plugin.Plugin, log *slog.Logger) error {
	params, err := plugin.ParseParams(s.AgentParams)
	if err != nil {
		return err
	}
	sum, err := RunDecode(ctx, DecodeConfig{Plugin: p, AgentParams: params, Model: s.Model, Engine: s.Engine, Ranks: s.Ranks,
		EngineID: s.EngineID, PrefillURL: s.PrefillURL, Workload: s.Workload, Concurrency: 4, Logger: log})
	if err != nil {
		return err
	}
	return json.NewEncoder(os.Stdout).Encode(sum)
}

// child is a running child process.
type child struct {
	cmd   *exec.Cmd
	lines chan []byte   // stdout, line by line; closed at EOF
	done  chan struct{} // closed once the child was reaped
}

func startChild(t testing.TB, role string, spec childSpec) *child {
	t.Helper()
	b, err := json.Marshal(spec)
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	// Under -race a child would sleep 1 s at exit (GORACE atexit_sleep_ms).
	gorace := strings.TrimSpace(os.Getenv("GORACE") + " atexit_sleep_ms=0")
	cmd.Env = append(os.Environ(), childEnv+"="+role, specEnv+"="+string(b), "GORACE="+gorace)
	cmd.Stderr = os.Stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	c := &child{cmd: cmd, lines: make(chan []byte, 16), done: make(chan struct{})}
	go func() {
		sc := bufio.NewScanner(out)
		sc.Buffer(nil, 16<<20)
		for sc.Scan() {
			c.lines <- append([]byte(nil), sc.Bytes()...)
		}
		io.Copy(io.Discard, out)
		close(c.lines)
		cmd.Wait()
		close(c.done)
	}()
	t.Cleanup(func() {
		select {
		case <-c.done:
			return
		default:
		}
		cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-c.done:
		case <-time.After(5 * time.Second):
			cmd.Process.Kill()
			<-c.done
		}
	})
	return c
}

// line reads the child's next stdout line as JSON into v.
func (c *child) line(t testing.TB, v any) {
	t.Helper()
	select {
	case b, ok := <-c.lines:
		if !ok {
			t.Fatalf("child ended without the expected output")
		}
		if err := json.Unmarshal(b, v); err != nil {
			t.Fatalf("child line %q: %v", b, err)
		}
	case <-time.After(90 * time.Second):
		t.Fatal("child said nothing for 90 s")
	}
}
