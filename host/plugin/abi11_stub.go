package plugin

// TEMPORARY: stand-ins for the ABI 1.1 calls that wt-abi11 adds to this
// package (EventFD, DrainEvents, SubmitPrepped, SubmitBatch, PollRelease),
// emulated over ABI 1.0 calls. Deleted when that branch is merged.

import "github.com/kvhost/kvhost/abi"

// EventFD returns the agent's event descriptor (never: 1.0 emulation).
func (a *Agent) EventFD() (fd int, ok bool) { return -1, false }

// DrainEvents clears the agent's event descriptor.
func (a *Agent) DrainEvents() error { return nil }

// SubmitPrepped makes and posts a prepped transfer.
func (a *Agent) SubmitPrepped(op abi.Op, local *DList, localIdx []int32, remote *DList, remoteIdx []int32, notif []byte) (*Xfer, bool, error) {
	x, err := a.MakePreppedXfer(op, local, localIdx, remote, remoteIdx, notif)
	if err != nil {
		return nil, false, err
	}
	return submitPost(x)
}

// SubmitBatch makes and posts a batch transfer.
func (a *Agent) SubmitBatch(op abi.Op, pairs []Pair, entries []abi.BatchEntry, notif []byte) (*Xfer, bool, error) {
	x, err := a.MakeBatchXfer(op, pairs, entries, notif)
	if err != nil {
		return nil, false, err
	}
	return submitPost(x)
}

func submitPost(x *Xfer) (*Xfer, bool, error) {
	done, err := x.Post()
	if err != nil {
		x.Close()
		return nil, false, err
	}
	return x, done, nil
}

// PollRelease polls; when done it reads the telemetry and releases x.
func (x *Xfer) PollRelease() (done bool, tel Telemetry, err error) {
	done, err = x.Poll()
	if err != nil || !done {
		return done, Telemetry{}, err
	}
	if x.a.caps.Has(abi.CapTelemetry) {
		tel, _ = x.Telemetry()
	}
	return true, tel, x.Close()
}
