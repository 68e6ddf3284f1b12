package pull

import "github.com/kvhost/kvhost/host/plugin"

// The sides of the KV transfers in the pull design, for the agents the
// caller creates (plugin.ForSide): the receiver (vLLM's decode) reads, so
// it initiates; the sender (vLLM's prefill) is read from.
const (
	ReceiverSide = plugin.Initiator
	SenderSide   = plugin.Target
)
