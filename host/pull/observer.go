package pull

import "time"

// Observer receives the runtime's events as they happen, for metrics. Its
// methods are called from the runtime's goroutines (several at once) and
// must be fast and safe for concurrent use. Embed NopObserver to implement
// only some of them.
type Observer interface {
	// Transfer: a READ completed (decode).
	Transfer(TransferStat)
	// FailedTransfer: a READ could not be made or posted, failed, or timed
	// out (decode).
	FailedTransfer()
	// FailedNotification: a notification-only message could not be sent
	// (decode, full prefix hit).
	FailedNotification()
	// Handshake: a handshake with a remote engine finished, err nil on
	// success (decode). d covers fetch, decode, validation and list prep.
	Handshake(d time.Duration, err error)
	// Released: the prefill freed a held request (prefill).
	Released(Release)
	// BadNotification: the prefill got a notification it cannot use: for
	// an unknown or already released request, or malformed (prefill).
	BadNotification(reason BadNotifReason)
}

// BadNotifReason says why a prefill ignored a notification.
type BadNotifReason string

// Reasons a notification is ignored.
const (
	// NotifUnknown names a request the prefill does not hold: never held,
	// already released (for example expired), or a surplus notification.
	// One kept for a hold to come (early.go) counts when it expires
	// unused, or at once when the bounds refuse to keep it.
	NotifUnknown BadNotifReason = "unknown_request"
	// NotifMalformed is not "{request_id}:{count}".
	NotifMalformed BadNotifReason = "malformed"
)

// NopObserver ignores every event.
type NopObserver struct{}

func (NopObserver) Transfer(TransferStat)            {}
func (NopObserver) FailedTransfer()                  {}
func (NopObserver) FailedNotification()              {}
func (NopObserver) Handshake(time.Duration, error)   {}
func (NopObserver) Released(Release)                 {}
func (NopObserver) BadNotification(r BadNotifReason) {}
