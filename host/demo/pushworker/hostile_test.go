package pushworker

import (
	"context"
	"testing"
	"time"

	"github.com/kvhost/kvhost/host/bootstrap"
	"github.com/kvhost/kvhost/host/internal/zmq"
	"github.com/kvhost/kvhost/host/wire/sglang"
)

// TestForeignInfosAreNotLeaks: a peer sending transfer infos (and ABORTs)
// for rooms the prefill worker never had does not turn its exit status:
// only rooms the worker opened count as leaked (issue 12: a hostile peer
// turned a healthy prefill's exit status to 1).
func TestForeignInfosAreNotLeaks(t *testing.T) {
	const foreign = 50
	sent := make(chan error, 1)
	c := pair{shape: smallShape(), wl: smallWL(), ptp: 1, dtp: 1}
	c.pready = func(addr string) {
		sent <- func() error {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			ri, err := bootstrap.NewClient(addr).Route(ctx, 0, 0, 0, 0)
			if err != nil {
				return err
			}
			p, err := zmq.DialPush(zmq.TCPEndpoint(ri.RankIP, ri.RankPort))
			if err != nil {
				return err
			}
			defer p.Close()
			for i := 0; i < foreign; i++ {
				f, err := (&sglang.NIXLTransferInfo{Room: 1<<50 + uint64(i), Endpoint: "127.0.0.1", Port: 9, AgentName: "stranger",
					DstKVIndices: []int32{1, 2, 3}, RequiredDstInfoNum: 1, DecodePrefixLenSet: true}).Frames()
				if err != nil {
					return err
				}
				if err := p.Send(ctx, f...); err != nil {
					return err
				}
			}
			return nil
		}()
	}
	ps, ds := runPair(t, c)
	if err := <-sent; err != nil {
		t.Fatal(err)
	}
	expectAllOK(t, ps, ds)
	if ps.Leaked != 0 {
		t.Fatalf("prefill leaked %d rooms", ps.Leaked)
	}
}
