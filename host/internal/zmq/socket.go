package zmq

import "context"

// Sender is what the control plane needs to send a multipart message to
// one peer; *Push implements it (tests substitute fakes).
type Sender interface {
	Send(ctx context.Context, frames ...[]byte) error
	Close() error
}

// Receiver is what the control plane needs to receive multipart messages;
// *Pull implements it.
type Receiver interface {
	Recv(ctx context.Context) ([][]byte, error)
	Close() error
}

var (
	_ Sender   = (*Push)(nil)
	_ Sender   = (*Dealer)(nil)
	_ Receiver = (*Pull)(nil)
	_ Receiver = (*Dealer)(nil)
)
