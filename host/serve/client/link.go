package client

import (
	"context"

	"github.com/kvhost/kvhost/host/internal/zmq"
)

// dealerLink is the client's DEALER socket (host/internal/zmq).
type dealerLink struct{ d *zmq.Dealer }

func dialLink(ctx context.Context, endpoint string) (link, error) {
	// The sidecar's replies and events may be as large as its
	// max_message; the client takes what its sidecar sends.
	d, err := zmq.DialDealer(endpoint, zmq.WithMaxMessageSize(1<<30))
	if err != nil {
		return nil, err
	}
	return &dealerLink{d: d}, nil
}

func (l *dealerLink) send(ctx context.Context, msg []byte) error { return l.d.Send(ctx, msg) }

// recv returns the next one-frame message; the first connection end
// (zmq.ErrDisconnected) is the end of the session.
func (l *dealerLink) recv() ([]byte, error) {
	for {
		m, err := l.d.Recv(context.Background())
		if err != nil {
			return nil, err
		}
		if len(m) == 1 {
			return m[0], nil
		}
	}
}

func (l *dealerLink) close() error { return l.d.Close() }
