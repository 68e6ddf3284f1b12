// Package apiconformance proves, against a live `kvhost serve` process,
// that the sidecar keeps the promises of docs/engine-api.md, speaking to it
// only as a third-party engine would: one DEALER socket per engine and
// hand-built msgpack maps (host/internal/zmq and host/internal/msgpack are
// the wire pieces; host/serve/client, whose conveniences could hide a
// broken promise, is not used).
//
// Its tests (package apiconformance, *_test.go) check every error code and
// when it applies, which code wins when several apply, that one
// connection's requests are answered in order and exactly once with their
// seq echoed, that room states only move forward and Success and Failed are
// final, what close_rank, a closed connection, a killed engine process and
// SIGTERM of the sidecar do to rooms, reads and held requests (and what
// peers see), and every documented bound (message size, regions, ranks and
// rooms per connection, held requests' ids, the connection cap and who is
// evicted). Data moves through the fake plugin, and every byte that lands
// is checked against what the other engine wrote.
//
// The sidecar under test is the binary named by $KVHOST_CONFORMANCE_BIN
// (or the -kvhost test flag), by default bin/kvhost of the checkout that
// `make` builds; it finds its plugins as kvhost does (lib/kvhost beside
// the binary, or $KVHOST_PLUGIN_PATH). A missing binary fails the tests:
// it is never a skip.
//
// hardening_test.go holds the checks of what the third hardening round
// fixed (Success final, the served bootstrap port, shrunk memory, bounded
// replies, bursts, dead prefills deregistered).
package apiconformance
