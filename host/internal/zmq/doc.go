// Package zmq is kvhost's ZeroMQ: a small, pure-Go implementation of the
// ZMTP 3.1 wire protocol (NULL security, over TCP and ipc) with exactly the
// socket patterns the control plane needs, so a kvhost worker can talk to
// SGLang and vLLM peers that use libzmq (pyzmq):
//
//   - PULL (bind) and PUSH (connect, one socket per destination endpoint) for
//     SGLang's bootstrap, transfer-info, status and abort messages;
//   - ROUTER (bind) and a one-shot REQ exchange for vLLM's NIXL handshake;
//   - ROUTER (bind) for the control socket of `kvhost serve`, which engine
//     processes reach with libzmq DEALER sockets, and DEALER (connect) for
//     Go clients of it.
//
// Every blocking call takes a context.Context; a cancelled or expired
// context interrupts it.
//
// # Endpoints
//
// "tcp://host:port" (binding: "tcp://*:port", port 0 picks a free port)
// and "ipc://path", a unix-domain stream socket, as libzmq's ipc
// transport: everything after "ipc://" is the socket file's path
// (IPCEndpoint), and "ipc://@name" is a Linux abstract socket (no file).
// Binding ipc is implemented for Linux only. A bound ipc socket:
//
//   - creates its file with mode 0600 (WithSocketMode): the mode is set
//     between bind and listen, so no peer can connect before it applies;
//     an abstract socket has no file, so it applies the same bits itself
//     to each peer's credentials before the handshake;
//   - refuses to start (an error wrapping syscall.EADDRINUSE) when a
//     listener answers at the path or the path is not a socket, and
//     removes a stale socket file (one whose connection attempt is
//     refused: its listener died without removing it); the live
//     listener sees the probe as a peer that left in its handshake;
//   - removes its file on Close, unless another listener has replaced it;
//   - expects a directory that others cannot write to (or a sticky one,
//     like /tmp): whoever can replace the file there can take the
//     endpoint over whatever its mode;
//   - tells who each peer is: the kernel's SO_PEERCRED (PeerCred: PID,
//     UID, GID) is on every RouterMsg (Cred) and names the peer in logs;
//   - shares the connection limit (WithMaxConns) fairly between peer
//     processes instead of IP addresses (see PeerCred's source method):
//     every ipc peer is of the socket's user anyway, and a process that
//     leaks connections then gives them up before another loses any.
//
// Pull.RecvFrom reports no address for ipc peers (unix sockets have none)
// and Port is 0 for ipc endpoints.
//
// # Learning that a peer is gone
//
// A sidecar must learn at once that an engine process died, and a client
// that the sidecar did. A Router with WithDisconnectHandler calls the
// handler exactly once for every connection that completed its
// handshake, whatever ended it (the peer closed it or died, a protocol
// error, the idle timeout, eviction, Router.Disconnect, Router.Close),
// from Recv after that peer's last message, or from Close. A Dealer's
// Recv returns an error wrapping ErrDisconnected once per connection,
// after the messages received on it; its next Send reconnects. Over ipc
// the kernel closes a dead process's sockets, so both notice at once;
// over TCP a peer host that vanishes is noticed by keep-alives
// (DefaultKeepAlive) or the idle timeout. A bound socket whose connections
// are sessions (the sidecar's control socket) should turn the idle
// timeout off (WithIdleTimeout(0)) unless its clients send heartbeats:
// libzmq peers are silent while idle, and the timeout would end the
// session of an engine that merely had nothing to say.
//
// # Why not go-zeromq/zmq4 or libzmq
//
// kvhost is built with CGO_ENABLED=0, so pebbe/zmq4 (cgo) is out. The
// pure-Go github.com/go-zeromq/zmq4 was evaluated and rejected on evidence
// (each point reproduced against v0.17.0 when this package was written):
//
//   - a peer that sends one 9-byte frame header declaring a 2^44-byte frame
//     makes its reader allocate the whole frame up front: the process dies
//     with "fatal error: runtime: out of memory" (not recoverable);
//   - its accept loop runs the ZMTP handshake inline without a deadline, so
//     one TCP client that connects and stays silent stops every later peer
//     from connecting;
//   - a PUSH socket whose peer restarted returns nil from Send and silently
//     drops the messages (no reconnect without WithAutoReconnect, which
//     redials synchronously inside the connection's error callback);
//   - PUSH fans out to every connected peer, Recv has no deadline, and the
//     ROUTER deadlock (go-zeromq/zmq4#132) is open.
//
// libzmq through purego would work but makes libzmq5 a run-time dependency
// and ties an OS thread to every blocking call. The part of ZMTP kvhost
// needs is small (greeting, READY, frames, PING/PONG, ERROR), so it lives
// here, fuzzed and bounded.
//
// # Guarantees
//
//   - Nothing a peer sends can make this package allocate more than
//     MaxMessageSize bytes per message (memory grows with bytes actually
//     received, never with a declared length), block the accept loop, or
//     panic. Handshakes run per connection under a deadline, and until
//     READY only a command (at most 64 KiB) is read. A peer of a bound
//     socket (PULL, ROUTER) that starts a message must finish it within
//     30 s or is dropped (time the socket itself spends waiting for its
//     receive budget does not count); between messages a peer may stay
//     idle up to the idle timeout (DefaultIdleTimeout, 5 min), after which
//     it is dropped (libzmq peers and Push reconnect when they next send).
//   - One peer cannot hold up the others. A message of at most 64 KiB
//     never waits for the receive budget; a larger one waits at most
//     about 1 s for peers that hold part of the budget with unfinished
//     messages: while a message waits, every connection holding part of
//     a message must finish it within 1 s or is dropped. (A peer that
//     keeps reconnecting to do that again can delay each such message by
//     that second.) A bound socket keeps at most MaxConns connections
//     past their handshake and as many more (at most 1024) in it; when a
//     new connection finishes its handshake with the socket full, a
//     source (IP address; for ipc, the peer process) holding the most
//     connections gives up its least recently active one: at once if it holds at least two more than the
//     new connection's source, otherwise only one idle for 1 s. So no
//     source can take every slot from another, idle connections give way
//     to new ones, and active ones are not pushed out by new connections
//     of their own host. A connection that cannot get in is refused
//     before it may send a message.
//   - What all peers send together is bounded too. A bound socket holds
//     at most its receive budget plus one message, plus 64 KiB for each
//     connection and each message queued for Recv, of received data:
//     while the budget is spent it stops reading larger messages, so the
//     senders are held back by TCP flow control, and nothing is dropped.
//     With the defaults that is at most about 264 MiB of messages and
//     128 MiB of read buffers (64 KiB per connection, handshakes
//     included) per socket (see the Default constants).
//   - Every log line a peer can trigger is rate-limited
//     (host/internal/ratelog), with a count of what was suppressed.
//   - Push.Send returns nil only after the whole message was handed to the
//     kernel on a live connection. A failed write closes the connection and
//     the message is re-sent on a new one (a partially written message is
//     discarded by the receiver, so nothing is delivered twice). Before
//     each write Send checks, without consuming data, whether the peer has
//     already closed the connection, so a peer that went away is noticed
//     before a message is written into a dead socket.
//   - Router.Enqueue never blocks and starts no goroutine for a peer
//     that has nothing waiting: it writes the message itself with one
//     non-blocking writev (a goroutine per reply cost a scheduler wakeup
//     of another thread, more CPU than the write). What the socket does
//     not take, every message behind it, and a burst's messages after
//     its first two (they batch), are written in order by a goroutine
//     of that peer, each write within the send timeout; the
//     connection's writer lock stays held from a message's first part
//     to its last, so nothing (Send, a PONG, the next message) comes
//     between them. A peer that does not read is refused (ErrPeerBusy)
//     at WithSendQueue messages or WithSendQueueBytes bytes waiting.
//   - As with libzmq, a message written just before the peer dies (or
//     sitting unread in the dead peer's buffers) is lost; the control plane
//     covers that with timeouts and heartbeats, as SGLang's disaggregation/{nixl,mori}/conn.py does.
//   - All sockets are safe for concurrent use (libzmq sockets are not).
package zmq
