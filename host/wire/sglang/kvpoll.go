package sglang

import "fmt"

// KVPoll is SGLang's transfer state of a request (base/conn.py KVPoll):
// what poll() returns on either side, and what MORI status messages carry.
// The numbering is SGLang's and is on the wire.
type KVPoll int

// KVPoll values, with SGLang's numbering.
const (
	KVPollFailed          KVPoll = 0
	KVPollBootstrapping   KVPoll = 1
	KVPollWaitingForInput KVPoll = 2
	KVPollTransferring    KVPoll = 3
	KVPollSuccess         KVPoll = 4
)

// String returns SGLang's name, e.g. "WaitingForInput".
func (p KVPoll) String() string {
	switch p {
	case KVPollFailed:
		return "Failed"
	case KVPollBootstrapping:
		return "Bootstrapping"
	case KVPollWaitingForInput:
		return "WaitingForInput"
	case KVPollTransferring:
		return "Transferring"
	case KVPollSuccess:
		return "Success"
	}
	return fmt.Sprintf("KVPoll(%d)", int(p))
}

// Terminal reports whether p is final: Failed or Success.
func (p KVPoll) Terminal() bool { return p == KVPollFailed || p == KVPollSuccess }
