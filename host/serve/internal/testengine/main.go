// Command testengine is a stand-in serving engine for kvhost serve's
// tests: one process, one connection to a sidecar, TP ranks whose KV
// lives in POSIX shared memory (host/serve/internal/fakeengine). It runs
// SGLang rooms on every rank and verifies every byte on decode.
//
// It prints one line per step on stdout, which the tests wait for:
// "BOOTSTRAP host:port" (prefill with -start-bootstrap), "READY" once its
// ranks are open, "CREATED" (-hold: every room created, now waiting to be
// killed; prefill then "INFLIGHT" once decode's metadata arrived for
// all of them), then "OK" or "FAIL reason" per room, and exits 0 when every
// room succeeded.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/kvhost/kvhost/host/serve/client"
	"github.com/kvhost/kvhost/host/serve/internal/fakeengine"
)

func main() {
	control := flag.String("control", "", "sidecar control endpoint")
	role := flag.String("role", "prefill", "prefill or decode")
	tp := flag.Int("tp", 1, "TP size (ranks of this engine)")
	mla := flag.Bool("mla", false, "MLA shape")
	vram := flag.Bool("vram", false, "register KV as VRAM (stand-in CUDA IPC handles)")
	layers := flag.Int("layers", 2, "layers")
	pages := flag.Int("pages", 64, "pages per rank")
	rooms := flag.String("rooms", "1", "comma-separated room ids")
	tokens := flag.Int("tokens", 30, "tokens per request")
	chunk := flag.Int("chunk", 2, "pages per sender_send")
	boot := flag.String("bootstrap", "", "decode: the prefill's bootstrap address; prefill: register with it")
	startBoot := flag.Bool("start-bootstrap", false, "prefill: start the sidecar's bootstrap server")
	hold := flag.Bool("hold", false, "create every room, print CREATED and wait (to be killed)")
	timeout := flag.Duration("timeout", 60*time.Second, "give up after this long")
	flag.Parse()
	if err := run(*control, *role, *tp, *mla, *vram, *layers, *pages, *rooms, *tokens, *chunk, *boot, *startBoot, *hold, *timeout); err != nil {
		fmt.Println("FAIL", err)
		os.Exit(1)
	}
}

func run(control, role string, tp int, mla, vram bool, layers, pages int, roomList string, tokens, chunk int, boot string, startBoot, hold bool, timeout time.Duration) error {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	c, err := client.Dial(ctx, control, client.Options{Name: "testengine-" + role})
	if err != nil {
		return err
	}
	defer c.Close()
	w := fakeengine.Watch(c)
	if startBoot {
		if boot, err = c.StartBootstrap(ctx, "127.0.0.1", 0); err != nil {
			return err
		}
		fmt.Println("BOOTSTRAP", boot)
	}
	shape := fakeengine.Shape{Layers: layers, KVHeads: 4, HeadBytes: 16, PageSize: 4, Pages: pages, AuxItems: 8, MLA: mla}
	var ranks []*fakeengine.Rank
	defer func() {
		for _, r := range ranks {
			r.Close()
		}
	}()
	for i := 0; i < tp; i++ {
		r, err := fakeengine.NewRank(fmt.Sprintf("/kvte-%d-%d", os.Getpid(), i), role, shape, tp, i)
		if err != nil {
			return err
		}
		ranks = append(ranks, r)
		r.VRAM = vram
		b := boot
		if role == "decode" {
			b = ""
		}
		if err := r.Open(ctx, c, "nixl", b); err != nil {
			return err
		}
	}
	fmt.Println("READY")
	var ids []uint64
	for _, s := range strings.Split(roomList, ",") {
		id, err := strconv.ParseUint(strings.TrimSpace(s), 10, 64)
		if err != nil {
			return fmt.Errorf("-rooms: %w", err)
		}
		ids = append(ids, id)
	}
	if hold {
		for _, r := range ranks {
			for _, id := range ids {
				var err error
				if role == "prefill" {
					err = c.SenderCreate(ctx, r.ID, id)
				} else {
					err = c.ReceiverCreate(ctx, r.ID, id, boot, -1)
				}
				if err != nil {
					return err
				}
			}
		}
		fmt.Println("CREATED")
		if role == "prefill" {
			// Wait for decode's metadata: the rooms are in flight.
			for _, r := range ranks {
				for _, id := range ids {
					if _, err := w.Wait(ctx, r.ID, id, client.StateWaitingForInput); err != nil {
						return err
					}
				}
			}
			fmt.Println("INFLIGHT")
		}
		<-ctx.Done()
		return ctx.Err()
	}
	var mu sync.Mutex
	var wg sync.WaitGroup
	var failed error
	for _, id := range ids {
		for _, r := range ranks {
			wg.Add(1)
			go func() {
				defer wg.Done()
				q := fakeengine.Request{Room: id, Tokens: tokens, Chunk: chunk}
				var err error
				if role == "prefill" {
					err = fakeengine.Prefill(ctx, c, w, r, q)
				} else {
					err = fakeengine.Decode(ctx, c, w, r, boot, q)
				}
				mu.Lock()
				defer mu.Unlock()
				if err != nil {
					fmt.Printf("FAIL room %d tp%d: %v\n", id, r.TP, err)
					failed = err
				} else {
					fmt.Printf("OK room %d tp%d\n", id, r.TP)
				}
			}()
		}
	}
	wg.Wait()
	return failed
}
