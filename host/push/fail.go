package push

// Fail fails the room with reason (the first reason wins), cancels its
// transfers and tells decode, as Abort does with SGLang's abort reason. A
// host that drives the rank for an engine (kvhost serve) fails rooms with
// its own reasons: "engine disconnected", "sidecar shutting down".
func (s *Sender) Fail(reason string) { s.fail(reason, false) }

// Fail fails the room with reason and tells every target prefill rank
// with ABORT, as Abort does with SGLang's abort reason.
func (r *Receiver) Fail(reason string) { r.failAbort(reason) }
