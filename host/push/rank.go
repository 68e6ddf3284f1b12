package push

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvhost/kvhost/host/internal/clock"
	"github.com/kvhost/kvhost/host/internal/ratelog"
	"github.com/kvhost/kvhost/host/plugin"
	"github.com/kvhost/kvhost/host/push/rooms"
)

// rank is what a Prefill and a Decode both are: a plugin agent holding
// this rank's registered buffers, the PULL socket peers send control
// messages to, the pushers it sends with, its room table, and the
// goroutines serving them (in wg, ended by ctx).
type rank struct {
	set   Settings
	log   *slog.Logger    // rate-limited: peers can trigger most of its lines
	rlog  *ratelog.Logger // log's limiter, flushed by shutdown
	obs   Observer
	agent *plugin.Agent
	regs  *registered
	clock clock.Clock // every protocol time and timeout
	tr    Transport
	pull  Inbox
	push  Outbox
	rooms *rooms.Table
	drops dropLog

	ctx    context.Context // ends when the rank closes
	cancel context.CancelFunc
	// farewell ends closeGrace after the rank starts closing: messages a
	// closing rank still owes its peers (a failed room's ABORT) use it,
	// so they are not cut off by ctx before they leave, nor hold Close
	// up for long on a peer that is gone.
	farewell       context.Context
	farewellCancel context.CancelFunc
	wg             sync.WaitGroup
	closed         atomic.Bool
}

// rankSetup is what rank.open needs from a PrefillConfig or DecodeConfig.
type rankSetup struct {
	role        Role
	plugin      *plugin.Plugin
	agentName   string
	agentParams []plugin.Param
	parallel    Parallel
	settings    Settings
	observer    Observer
	logger      *slog.Logger
	transport   Transport   // nil: ZMQ{}
	clock       clock.Clock // nil: the wall clock
}

// checkConfig checks and completes the fields both configs share.
func checkConfig(p *Parallel, kv *KVArgs, mla bool, plug *plugin.Plugin, host, kvCacheDType *string) error {
	*p = p.withDefaults()
	if err := p.check(); err != nil {
		return err
	}
	if err := kv.check(mla); err != nil {
		return err
	}
	if plug == nil {
		return errors.New("push: no plugin")
	}
	if *host == "" {
		*host = "127.0.0.1"
	}
	if *kvCacheDType == "" {
		*kvCacheDType = "auto"
	}
	return nil
}

// open sets up the logger, observer and room table and creates the
// agent. On error nothing is left open.
func (r *rank) open(s rankSetup) error {
	r.set, r.log, r.obs = s.settings.withDefaults(), s.logger, s.observer
	r.clock, r.tr = clock.Or(s.clock), s.transport
	if r.tr == nil {
		r.tr = ZMQ{}
	}
	if r.log == nil {
		r.log = slog.Default()
	}
	r.rlog = ratelog.New(r.log)
	r.log = r.rlog.With("role", s.role.String(), "tp", s.parallel.TPRank, "pp", s.parallel.PPRank)
	if r.obs == nil {
		r.obs = NopObserver{}
	}
	r.rooms = rooms.NewTableOn(r.clock, func(c rooms.Change) { r.obs.Room(RoomEvent{Role: s.role, Change: c}) })
	r.drops.log = r.log
	name := s.agentName
	if name == "" {
		name = uniqueName(s.role.String(), s.parallel)
	}
	var err error
	if r.agent, err = s.plugin.NewAgent(name, s.plugin.ForSide(s.role.Side(), s.agentParams)...); err != nil {
		return fmt.Errorf("push: create agent: %w", err)
	}
	return nil
}

// listen registers kv with the agent and binds the PULL socket;
// sendTimeout bounds each send (0: the transport's default). On error the
// caller calls shutdown.
func (r *rank) listen(kv *KVArgs, host string, port int, sendTimeout time.Duration) error {
	var err error
	if r.regs, err = register(r.agent, kv); err != nil {
		return err
	}
	if r.pull, err = r.tr.Listen(tcpEndpoint(host, port), r.log); err != nil {
		return fmt.Errorf("push: bind PULL socket: %w", err)
	}
	r.push = r.tr.Outbox(r.log, sendTimeout)
	r.ctx, r.cancel = context.WithCancel(context.Background())
	r.farewell, r.farewellCancel = context.WithCancel(context.Background())
	return nil
}

// goServe runs handle on every message the PULL socket receives, in a
// goroutine, until the rank closes. A receive error is logged and the
// loop goes on.
func (r *rank) goServe(handle func(frames [][]byte)) {
	r.goServeFrom(func(frames [][]byte, _ net.Addr) { handle(frames) })
}

// goServeFrom is goServe for a handler that also takes the remote address
// of the connection each message came on.
func (r *rank) goServeFrom(handle func(frames [][]byte, from net.Addr)) {
	r.wg.Add(1)
	go func() {
		defer r.wg.Done()
		for {
			frames, from, err := r.pull.RecvFrom(r.ctx)
			if err != nil {
				if r.ctx.Err() != nil || errors.Is(err, net.ErrClosed) {
					return
				}
				r.log.Warn("receive failed", "err", err)
				continue
			}
			handle(frames, from)
		}
	}()
}

// goRun runs fn in a goroutine of the rank.
func (r *rank) goRun(fn func()) {
	r.wg.Add(1)
	go func() {
		defer r.wg.Done()
		fn()
	}()
}

// goEvery calls fn every period, in a goroutine of the rank, until the
// rank closes.
func (r *rank) goEvery(period time.Duration, fn func(now time.Time)) {
	r.goRun(func() {
		t := r.clock.NewTicker(period)
		defer t.Stop()
		for {
			select {
			case <-r.ctx.Done():
				return
			case <-t.C():
				fn(r.clock.Now())
			}
		}
	})
}

// sweepPeriod is how often a timeout is checked: a tenth of it, between
// 10 ms and 1 s.
func sweepPeriod(timeout time.Duration) time.Duration {
	return min(max(timeout/10, 10*time.Millisecond), time.Second)
}

// shutdown ends the rank's goroutines and closes the sockets and the
// agent (releasing every plugin handle); the role fails its open rooms
// first. It also undoes a partial open or listen.
func (r *rank) shutdown() error {
	if r.farewellCancel != nil {
		grace := r.clock.AfterFunc(closeGrace, r.farewellCancel)
		defer grace.Stop()
		defer r.farewellCancel()
	}
	if r.cancel != nil {
		r.cancel()
	}
	var errs []error
	if r.pull != nil {
		errs = append(errs, r.pull.Close())
	}
	r.wg.Wait()
	if r.push != nil {
		errs = append(errs, r.push.Close())
	}
	errs = append(errs, r.agent.Close())
	r.rlog.Close()
	return errors.Join(errs...)
}

// Agent returns the rank's plugin agent.
func (r *rank) Agent() *plugin.Agent { return r.agent }

// Endpoint returns the rank's PULL socket endpoint ("tcp://ip:port").
func (r *rank) Endpoint() string { return r.pull.Endpoint() }

// Rooms returns the number of rooms the rank holds: open senders or
// receivers, and rooms that finished but were not closed yet.
func (r *rank) Rooms() int { return r.rooms.Len() }

// Dropped returns how many malformed or unexpected control messages the
// rank dropped.
func (r *rank) Dropped() int64 { return r.drops.total.Load() }

func uniqueName(role string, p Parallel) string {
	var b [6]byte
	rand.Read(b[:])
	return fmt.Sprintf("kvhost-%s-dp%d-tp%d-pp%d-pid%d-%s", role, p.DPRank, p.TPRank, p.PPRank, os.Getpid(), hex.EncodeToString(b[:]))
}

// dropLog counts dropped messages and logs each through the rank's
// rate-limited logger, so a hostile peer cannot flood the log.
type dropLog struct {
	log   *slog.Logger
	total atomic.Int64
}

func (d *dropLog) drop(what string, err error) {
	d.total.Add(1)
	d.log.Warn("dropped "+what, "err", err)
}
