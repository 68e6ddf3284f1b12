package main

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/urfave/cli/v2"
)

// runKvhost runs the CLI in process with stdin and returns stdout and the
// error main would print.
func runKvhost(t *testing.T, stdin string, args ...string) (string, error) {
	t.Helper()
	app := newApp()
	var out bytes.Buffer
	app.Reader = strings.NewReader(stdin)
	app.Writer = &out
	app.ErrWriter = &out
	app.ExitErrHandler = func(*cli.Context, error) {} // never os.Exit in tests
	err := app.Run(append([]string{"kvhost"}, args...))
	return out.String(), err
}

const sliceRequest = `{"style":"sglang-nixl","attention":"mha","page_size":2,
 "prefill":{"tp_size":1,"tp_rank":0,"kv_head_num":4,"kv_ptrs":[4096,8192],"kv_item_lens":[32,32],"num_pages":8},
 "decode":{"tp_size":2,"tp_rank":1,"kv_head_num":2,"kv_ptrs":[65536,131072],"kv_item_lens":[16,16],"num_pages":8},
 "prefill_pages":[3,4],"decode_pages":[0,1]}`

func TestPlanCommand(t *testing.T) {
	out, err := runKvhost(t, sliceRequest, "plan")
	if err != nil {
		t.Fatal(err)
	}
	var resp struct {
		Style, Kind, Path string
		Descriptors       int
		Expanded          uint64 `json:"expanded_descriptors"`
		Bytes             uint64
		Reference         uint64 `json:"reference_descriptors"`
		Copies            [][3]uint64
	}
	if err := json.Unmarshal([]byte(out), &resp); err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	// Decode rank 1 owns heads 2-3: bytes 8-15 of each 16-byte prefill
	// token, 4 tokens (pages 3-4), into whole 8-byte decode tokens.
	want := [][3]uint64{
		{4096 + 104, 65536, 8}, {4096 + 120, 65536 + 8, 8}, {4096 + 136, 65536 + 16, 8}, {4096 + 152, 65536 + 24, 8},
		{8192 + 104, 131072, 8}, {8192 + 120, 131072 + 8, 8}, {8192 + 136, 131072 + 16, 8}, {8192 + 152, 131072 + 24, 8},
	}
	if resp.Path != "nixl-prepped-slice" || resp.Kind != "kv" || resp.Descriptors != 2 || resp.Expanded != 8 ||
		resp.Bytes != 64 || resp.Reference != 8 || len(resp.Copies) != len(want) {
		t.Fatalf("response %+v", resp)
	}
	for i := range want {
		if resp.Copies[i] != want[i] {
			t.Errorf("copy %d: %v, want %v", i, resp.Copies[i], want[i])
		}
	}

	summary, err := runKvhost(t, sliceRequest, "plan", "--summary")
	if err != nil || strings.Contains(summary, "copies") || !strings.Contains(summary, `"descriptors":2`) {
		t.Errorf("--summary: %v %s", err, summary)
	}

	file := filepath.Join(t.TempDir(), "req.json")
	os.WriteFile(file, []byte(sliceRequest), 0o600)
	fromFile, err := runKvhost(t, "", "plan", "--in", file)
	if err != nil || fromFile != out {
		t.Errorf("--in: %v\n%s", err, fromFile)
	}
}

func TestPlanCommandErrors(t *testing.T) {
	tests := []struct {
		stdin string
		args  []string
		want  string
	}{
		{`{"style":"sglang-nixl","attention":"mha"`, nil, "plan: request: empty or truncated JSON"},
		{strings.Replace(sliceRequest, `"kv_item_lens":[16,16]`, `"kv_item_lens":[16]`, 1), nil,
			"plan: decode.kv_item_lens: length mismatch: got 1, expected 2"},
		{strings.Replace(sliceRequest, `"page_size":2`, `"page_size":"2"`, 1), nil, "plan: page_size: want an integer, got JSON string"},
		{strings.Replace(sliceRequest, `[3,4]`, `[3,40]`, 1), nil, "plan: prefill_pages[1]: page 40 outside [0, 8)"},
		{sliceRequest, []string{"--in", "/nonexistent/req.json"}, "plan: --in: open /nonexistent/req.json"},
		{sliceRequest, []string{"extra"}, `plan: unexpected argument "extra"`},
	}
	for _, tc := range tests {
		_, err := runKvhost(t, tc.stdin, append([]string{"plan"}, tc.args...)...)
		if err == nil || !strings.HasPrefix(err.Error(), tc.want) || strings.Contains(err.Error(), "\n") {
			t.Errorf("got %v, want one line starting %q", err, tc.want)
		}
	}
}

// FuzzPlanCommand: `kvhost plan` never panics, whatever arrives on stdin,
// and answers either JSON or one error line.
func FuzzPlanCommand(f *testing.F) {
	f.Add(sliceRequest)
	f.Add(`{"style":"sglang-mori","attention":"mla","page_size":1}`)
	f.Add(`{"style":"vllm"}`)
	f.Fuzz(func(t *testing.T, stdin string) {
		out, err := runKvhost(t, stdin, "plan", "--summary")
		if err != nil {
			if strings.Contains(err.Error(), "\n") {
				t.Fatalf("multi-line error %q", err)
			}
			return
		}
		if !json.Valid([]byte(out)) {
			t.Fatalf("not JSON: %.200s", out)
		}
	})
}
