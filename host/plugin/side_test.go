package plugin

import (
	"reflect"
	"strconv"
	"testing"
)

// ForSide adds num_threads to initiators only and prefault=false to
// targets only, only for a plugin that documents the key, and never over a
// key the caller set.
func TestForSide(t *testing.T) {
	documents := &Plugin{info: Info{ParamsDoc: []ParamDoc{{Key: "backend", Default: "UCX"}, {Key: ThreadsParam, Default: "0"}, {Key: PrefaultParam, Default: "true"}}}}
	silent := &Plugin{info: Info{ParamsDoc: []ParamDoc{{Key: "backend", Default: "UCX"}}}}
	user := []Param{{"backend", "UCX"}}
	want := strconv.Itoa(InitiatorThreads)
	off := Param{PrefaultParam, "false"}
	for _, c := range []struct {
		name   string
		p      *Plugin
		side   Side
		params []Param
		want   []Param
	}{
		{"initiator gets threads", documents, Initiator, user, []Param{{"backend", "UCX"}, {ThreadsParam, want}}},
		{"target gets no threads, prefault off", documents, Target, user, []Param{{"backend", "UCX"}, off}},
		{"undocumented key never sent", silent, Initiator, user, user},
		{"undocumented prefault never sent", silent, Target, user, user},
		{"caller's prefault wins", documents, Target, []Param{{PrefaultParam, "true"}}, []Param{{PrefaultParam, "true"}}},
		{"caller's value wins", documents, Initiator, []Param{{ThreadsParam, "0"}}, []Param{{ThreadsParam, "0"}}},
		{"no params", documents, Initiator, nil, []Param{{ThreadsParam, want}}},
	} {
		in := append([]Param(nil), c.params...)
		got := c.p.ForSide(c.side, c.params)
		if !reflect.DeepEqual(got, c.want) && !(len(got) == 0 && len(c.want) == 0) {
			t.Errorf("%s: ForSide(%v, %v) = %v, want %v", c.name, c.side, c.params, got, c.want)
		}
		if !reflect.DeepEqual(in, c.params) {
			t.Errorf("%s: ForSide changed its argument to %v", c.name, c.params)
		}
	}
	if Initiator.String() != "initiator" || Target.String() != "target" || Side(7).String() != "side(7)" {
		t.Errorf("Side strings: %v %v %v", Initiator, Target, Side(7))
	}
}

// WithLocalPeers keeps the first-touch pass for agents whose peers share
// the process: prefault=true, only where documented, never over the
// caller's value; ForSide then adds no target default over it.
func TestWithLocalPeers(t *testing.T) {
	documents := &Plugin{info: Info{ParamsDoc: []ParamDoc{{Key: PrefaultParam, Default: "true"}}}}
	silent := &Plugin{info: Info{ParamsDoc: []ParamDoc{{Key: "backend", Default: "UCX"}}}}
	on := Param{PrefaultParam, "true"}
	for _, c := range []struct {
		name   string
		p      *Plugin
		params []Param
		want   []Param
	}{
		{"added", documents, []Param{{"workers", "2"}}, []Param{{"workers", "2"}, on}},
		{"caller's value wins", documents, []Param{{PrefaultParam, "false"}}, []Param{{PrefaultParam, "false"}}},
		{"undocumented", silent, []Param{{"backend", "UCX"}}, []Param{{"backend", "UCX"}}},
	} {
		in := append([]Param(nil), c.params...)
		got := c.p.WithLocalPeers(c.params)
		if !reflect.DeepEqual(got, c.want) {
			t.Errorf("%s: WithLocalPeers(%v) = %v, want %v", c.name, c.params, got, c.want)
		}
		if !reflect.DeepEqual(in, c.params) {
			t.Errorf("%s: WithLocalPeers changed its argument to %v", c.name, c.params)
		}
		if got := c.p.ForSide(Target, c.p.WithLocalPeers(c.params)); !reflect.DeepEqual(got, c.want) {
			t.Errorf("%s: ForSide(Target, WithLocalPeers(%v)) = %v, want %v", c.name, c.params, got, c.want)
		}
	}
}

func TestMergeParams(t *testing.T) {
	base := []Param{{"a", "1"}, {"b", "2"}}
	got := MergeParams(base, []Param{{"b", "x"}, {"c", "3"}, {"c", "4"}})
	want := []Param{{"a", "1"}, {"b", "x"}, {"c", "4"}}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("MergeParams = %v, want %v", got, want)
	}
	if base[1].Value != "2" {
		t.Errorf("MergeParams modified base: %v", base)
	}
	if got := MergeParams(nil, nil); len(got) != 0 {
		t.Errorf("MergeParams(nil, nil) = %v", got)
	}
}

// The fake plugin documents num_threads, so the host's default reaches it;
// the agent remembers what it was created with; the fake checks the value.
func TestForSideFake(t *testing.T) {
	p := openFake(t)
	if !p.Info().HasParam(ThreadsParam) {
		t.Fatalf("the fake plugin does not document %s: %+v", ThreadsParam, p.Info().ParamsDoc)
	}
	a, err := p.NewAgent("side-initiator", p.ForSide(Initiator, []Param{{"workers", "2"}})...)
	if err != nil {
		t.Fatal(err)
	}
	want := []Param{{"workers", "2"}, {ThreadsParam, strconv.Itoa(InitiatorThreads)}}
	if got := a.Params(); !reflect.DeepEqual(got, want) {
		t.Errorf("initiator agent params = %v, want %v", got, want)
	}
	b, err := p.NewAgent("side-target", p.ForSide(Target, nil)...)
	if err != nil {
		t.Fatal(err)
	}
	if got, want := b.Params(), []Param{{PrefaultParam, "false"}}; !reflect.DeepEqual(got, want) {
		t.Errorf("target agent params = %v, want %v", got, want)
	}
	if _, err := p.NewAgent("side-bad", Param{ThreadsParam, "65"}); err == nil {
		t.Error("the fake accepted num_threads=65 (its range is 0..64)")
	}
}
