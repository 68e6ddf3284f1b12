package push_test

import (
	"testing"
	"time"

	"github.com/kvhost/kvhost/host/plugin"
	"github.com/kvhost/kvhost/host/push"
)

// TestChunkPlannedOnce: the worker plans each chunk's KV once per decode
// rank (strided copies or indices into the prepared lists), validates that
// plan and posts it, in both completion modes, and the bytes still arrive.
func TestChunkPlannedOnce(t *testing.T) {
	noNotif := []plugin.Param{{Key: "caps_off", Value: "notif"}}
	for _, c := range []struct {
		name   string
		xfer   push.XferMode
		params []plugin.Param
	}{
		{"batch-notif", push.XferBatch, nil},
		{"batch-status", push.XferBatch, noNotif},
		{"prepped-notif", push.XferPrepped, nil},
		{"prepped-status", push.XferPrepped, noNotif},
	} {
		t.Run(c.name, func(t *testing.T) {
			r := newRig(t, rigOpts{pparams: c.params, dparams: c.params, xfer: c.xfer, state: true})
			ctx := ctxT(t, 20*time.Second)
			q := r.prepare(7, 4*rigPageSize, 0) // 4 pages: 2 chunks of 2
			defer q.close()
			q.pstate, q.dstate = [][]int32{{1}}, [][]int32{{2}}
			var calls *push.PlanCalls
			r.afterReady = func() { calls = push.CountPlans(r.pf) }
			if err := r.transfer(ctx, q); err != nil {
				t.Fatal(err)
			}
			plans, indices := calls.Plans.Load(), calls.Indices.Load()
			want := [2]int64{2, 0} // one strided plan per chunk
			if c.xfer == push.XferPrepped {
				want = [2]int64{0, 2} // one index plan per chunk (one part)
			}
			if got := [2]int64{plans, indices}; got != want {
				t.Fatalf("2 chunks to 1 decode rank: %d strided plans and %d index plans, want %d and %d", plans, indices, want[0], want[1])
			}
		})
	}
}

// TestXferAuto: the zero XferMode (auto) posts strided batches on an agent
// with native strides, through prepared lists on one that has them
// natively but no strides, and plain batches on one with neither; every
// byte arrives either way.
func TestXferAuto(t *testing.T) {
	for _, c := range []struct {
		name   string
		params []plugin.Param
		want   push.XferMode
	}{
		{"native-strides", nil, push.XferBatch},
		{"native-prepped-no-strides", []plugin.Param{{Key: "caps_off", Value: "strided"}}, push.XferPrepped},
		{"no-prepped", []plugin.Param{{Key: "caps_off", Value: "prepped"}}, push.XferBatch},
		{"no-prepped-no-strides", []plugin.Param{{Key: "caps_off", Value: "prepped,strided"}}, push.XferBatch},
	} {
		t.Run(c.name, func(t *testing.T) {
			r := newRig(t, rigOpts{pparams: c.params, state: true})
			if got := r.pf.XferMode(); got != c.want {
				t.Fatalf("auto resolved to %v, want %v", got, c.want)
			}
			ctx := ctxT(t, 20*time.Second)
			q := r.prepare(9, 4*rigPageSize, 0)
			defer q.close()
			q.pstate, q.dstate = [][]int32{{1}}, [][]int32{{2}}
			var calls *push.PlanCalls
			r.afterReady = func() { calls = push.CountPlans(r.pf) }
			if err := r.transfer(ctx, q); err != nil {
				t.Fatal(err)
			}
			if prepped := calls.Indices.Load() > 0; prepped != (c.want == push.XferPrepped) || calls.Plans.Load()+calls.Indices.Load() != 2 {
				t.Fatalf("%d strided plans, %d index plans for 2 chunks in mode %v", calls.Plans.Load(), calls.Indices.Load(), c.want)
			}
		})
	}
}
