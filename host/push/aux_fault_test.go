package push_test

import (
	"os"
	"strings"
	"testing"
	"time"

	"github.com/kvhost/kvhost/host/push"
	"github.com/kvhost/kvhost/host/wire/sglang"

	"github.com/kvhost/kvhost/host/internal/memfault/memfaulttest"
)

// TestMORIAuxInShrunkMemory (issue 25.3): MORI moves aux bytes over ZeroMQ,
// read from the prefill's aux buffer and written into the decode's by Go
// code. An engine that shrank the shared memory of its aux buffer fails
// the room that touched it, with a reason naming the buffer (the copy
// faulted and killed the process), and the next room, once the memory is
// back, succeeds.
func TestMORIAuxInShrunkMemory(t *testing.T) {
	for _, shrink := range []string{"prefill", "decode"} {
		t.Run(shrink, func(t *testing.T) {
			var f *os.File
			r := newRig(t, rigOpts{variant: push.VariantMORI, sides: func(p, d *side) {
				s := p
				if shrink == "decode" {
					s = d
				}
				var mem []byte
				f, mem = memfaulttest.SharedMem(t, len(s.args.Aux[0].Mem))
				s.args.Aux[0].Mem = mem
			}})
			ctx := ctxT(t, 20*time.Second)
			run := func(room uint64, slot int) (prefill, decode error) {
				q := r.prepare(room, 8, slot)
				defer q.close()
				if err := r.open(ctx, q); err != nil {
					t.Fatal(err)
				}
				if err := q.s.Init(len(q.ppages), q.paux); err != nil {
					t.Fatal(err)
				}
				if err := q.s.Send(q.ppages, nil); err != nil {
					t.Fatal(err)
				}
				wait := func(st sglang.KVPoll, err error, failure error) error {
					if err != nil {
						t.Fatal(err)
					}
					if st != sglang.KVPollSuccess {
						return failure
					}
					return nil
				}
				ps, perr := q.s.Wait(ctx)
				prefill = wait(ps, perr, q.s.Failure())
				ds, derr := q.rcv.Wait(ctx)
				decode = wait(ds, derr, q.rcv.Failure())
				return prefill, decode
			}
			if p, d := run(1, 0); p != nil || d != nil {
				t.Fatalf("before the shrink: prefill %v, decode %v", p, d)
			}
			if err := f.Truncate(0); err != nil {
				t.Fatal(err)
			}
			p, d := run(2, 1)
			got := p
			if shrink == "decode" {
				got = d
			}
			t.Logf("%s shrank its aux memory: prefill %v; decode %v", shrink, p, d)
			if got == nil || !strings.Contains(got.Error(), "aux buffer 0") || !strings.Contains(got.Error(), "no longer mapped") {
				t.Fatalf("the %s's room with its aux memory gone: %v, want a failure naming aux buffer 0", shrink, got)
			}
			if d == nil {
				t.Fatal("the decode's room succeeded without its aux bytes")
			}
			if err := f.Truncate(int64(rigAuxSlots * rigAuxLen)); err != nil {
				t.Fatal(err)
			}
			if p, d := run(3, 2); p != nil || d != nil {
				t.Fatalf("after the memory came back: prefill %v, decode %v", p, d)
			}
		})
	}
}
