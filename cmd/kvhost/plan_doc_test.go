package main

import (
	"os"
	"strings"
	"testing"
)

// TestPlanDocExamples runs every worked example of docs/plan.md: a
// "```json request" block followed by a "```json response [flags]" block
// must produce exactly that response, and one followed by a
// "```text error" block must fail with exactly that line (as main prints
// it).
func TestPlanDocExamples(t *testing.T) {
	doc, err := os.ReadFile("../../docs/plan.md")
	if err != nil {
		t.Fatal(err)
	}
	type block struct{ info, body string }
	var blocks []block
	lines := strings.Split(string(doc), "\n")
	for i := 0; i < len(lines); i++ {
		info, ok := strings.CutPrefix(lines[i], "```json ")
		if !ok {
			if lines[i] != "```text error" {
				continue
			}
			info = "error"
		}
		var body []string
		for i++; i < len(lines) && lines[i] != "```"; i++ {
			body = append(body, lines[i])
		}
		blocks = append(blocks, block{info, strings.Join(body, "\n")})
	}
	examples, errExamples := 0, 0
	for i := 0; i+1 < len(blocks); i++ {
		if blocks[i].info != "request" {
			continue
		}
		resp := blocks[i+1]
		if resp.info == "error" {
			_, err := runKvhost(t, blocks[i].body, "plan")
			if err == nil || "kvhost: "+err.Error() != strings.TrimSpace(resp.body) {
				t.Errorf("error example %d: kvhost plan fails with\n%v\nthe doc shows\n%s", errExamples, err, resp.body)
			}
			errExamples++
			continue
		}
		args, ok := strings.CutPrefix(resp.info, "response")
		if !ok {
			t.Fatalf("request block %d is not followed by a response block", i)
		}
		out, err := runKvhost(t, blocks[i].body, append([]string{"plan"}, strings.Fields(args)...)...)
		if err != nil {
			t.Errorf("example %d: %v\n%s", examples, err, blocks[i].body)
		} else if strings.TrimSpace(out) != strings.TrimSpace(resp.body) {
			t.Errorf("example %d: kvhost plan prints\n%s\nthe doc shows\n%s", examples, out, resp.body)
		}
		examples++
	}
	if examples < 10 || errExamples < 4 {
		t.Errorf("found %d examples and %d error examples in docs/plan.md", examples, errExamples)
	}
}
