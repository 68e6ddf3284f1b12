package client

import (
	"context"
	"sync"

	"github.com/kvhost/kvhost/host/internal/zmq/zmqtest"
)

// rawLink is a DEALER connection over zmqtest.Raw, the stand-in until
// host/internal/zmq has a DEALER socket.
type rawLink struct {
	mu sync.Mutex
	r  *zmqtest.Raw
}

func dialLink(ctx context.Context, endpoint string) (link, error) {
	r, err := zmqtest.TryDialRaw(endpoint, "DEALER", "")
	if err != nil {
		return nil, err
	}
	return &rawLink{r: r}, nil
}

func (l *rawLink) send(ctx context.Context, msg []byte) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.r.Send(msg)
}

func (l *rawLink) recv() ([]byte, error) {
	for {
		m, err := l.r.Recv()
		if err != nil {
			return nil, err
		}
		if len(m) == 1 {
			return m[0], nil
		}
	}
}

func (l *rawLink) close() error { return l.r.Close() }
