"""libzmq (pyzmq) peer for host/internal/zmq interop tests.

Modes (first argument):
  push ENDPOINT      connect PUSH, send the standard messages, close (linger)
  push-heartbeat ENDPOINT
                     PUSH with ZMTP heartbeats every 50 ms (timeout 1 s):
                     send "one", idle 3 s, send "two", close
  pull [ENDPOINT]    bind PULL on 127.0.0.1 (or ENDPOINT), print "PORT <n>"
                     (0 for ENDPOINT), receive the standard messages and
                     print "OK <n>" when they match
  req ENDPOINT N     N times: new REQ socket, send [b"req", i], expect
                     [b"rep", i] back, close; print "OK <n>"
  router N [ENDPOINT]
                     bind ROUTER (on ENDPOINT: print "PORT 0"), print
                     "PORT <n>", answer N requests [id, b"", *frames] with
                     [id, b"", b"echo", *frames]
  router-dealer N [ENDPOINT]
                     bind ROUTER as router, answer N messages [id, *frames]
                     from DEALER peers with [id, b"echo", *frames]
  dealer ENDPOINT N  connect DEALER, send N messages [b"d", i] without
                     waiting, then expect N replies [b"echo", b"d", i] in
                     order; print "OK <n>"
  dealer-hold ENDPOINT
                     connect DEALER, send [b"hello"], print "SENT", then
                     wait to be killed

The standard messages are also built by the Go test (standardMessages).
"""
import sys

import zmq


def standard_messages():
    big = bytes(range(256)) * 4096  # 1 MiB, frames longer than 255 bytes
    return [
        [b"a"],
        [b"", b"x" * 300, b"end"],
        [big, b""],
        [b"NixlMsgGuard", b"12345", b"127.0.0.1", b"5555"],
    ] + [[b"seq", str(i).encode()] for i in range(100)]


def bind(s, endpoint):
    """Binds s to endpoint[0] if given (returns 0), else to a random TCP
    port on 127.0.0.1 (returns it)."""
    if endpoint:
        s.bind(endpoint[0])
        return 0
    return s.bind_to_random_port("tcp://127.0.0.1")


def main():
    mode = sys.argv[1]
    ctx = zmq.Context()
    if mode == "push":
        s = ctx.socket(zmq.PUSH)
        s.setsockopt(zmq.LINGER, 10000)
        s.connect(sys.argv[2])
        for m in standard_messages():
            s.send_multipart(m)
        s.close()
    elif mode == "push-heartbeat":
        import time
        s = ctx.socket(zmq.PUSH)
        s.setsockopt(zmq.LINGER, 10000)
        # A PULL that did not answer PINGs would be dropped within the
        # idle time (50 ms + 1 s < 3 s); the timeout leaves room for a
        # loaded machine (300 ms, with a 1.5 s idle, dropped a PULL that
        # answered late when the machine stalled).
        s.setsockopt(zmq.HEARTBEAT_IVL, 50)
        s.setsockopt(zmq.HEARTBEAT_TIMEOUT, 1000)
        s.setsockopt(zmq.HEARTBEAT_TTL, 3000)
        s.connect(sys.argv[2])
        s.send(b"one")
        time.sleep(3)
        s.send(b"two")
        s.close()
    elif mode == "pull":
        s = ctx.socket(zmq.PULL)
        s.setsockopt(zmq.RCVTIMEO, 20000)
        print("PORT", bind(s, sys.argv[2:3]), flush=True)
        want = standard_messages()
        for i, w in enumerate(want):
            got = s.recv_multipart()
            if got != w:
                raise SystemExit(f"message {i}: got {[len(f) for f in got]} frames {got[:2]!r}..., want {[len(f) for f in w]}")
        print("OK", len(want), flush=True)
        s.close()
    elif mode == "req":
        n = int(sys.argv[3])
        for i in range(n):
            s = ctx.socket(zmq.REQ)
            s.setsockopt(zmq.RCVTIMEO, 5000)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(sys.argv[2])
            s.send_multipart([b"req", str(i).encode()])
            rep = s.recv_multipart()
            if rep != [b"rep", str(i).encode()]:
                raise SystemExit(f"request {i}: bad reply {rep!r}")
            s.close()
        print("OK", n, flush=True)
    elif mode == "router":
        n = int(sys.argv[2])
        s = ctx.socket(zmq.ROUTER)
        s.setsockopt(zmq.RCVTIMEO, 20000)
        print("PORT", bind(s, sys.argv[3:4]), flush=True)
        for _ in range(n):
            frames = s.recv_multipart()
            ident, delim, body = frames[0], frames[1], frames[2:]
            if delim != b"":
                raise SystemExit(f"missing delimiter: {frames!r}")
            s.send_multipart([ident, b"", b"echo"] + body)
        print("OK", n, flush=True)
        s.close()
    elif mode == "router-dealer":
        n = int(sys.argv[2])
        s = ctx.socket(zmq.ROUTER)
        s.setsockopt(zmq.RCVTIMEO, 20000)
        print("PORT", bind(s, sys.argv[3:4]), flush=True)
        for _ in range(n):
            frames = s.recv_multipart()
            s.send_multipart([frames[0], b"echo"] + frames[1:])
        print("OK", n, flush=True)
        s.close()
    elif mode == "dealer":
        n = int(sys.argv[3])
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.RCVTIMEO, 10000)
        s.setsockopt(zmq.LINGER, 5000)
        s.connect(sys.argv[2])
        for i in range(n):
            s.send_multipart([b"d", str(i).encode()])
        for i in range(n):
            rep = s.recv_multipart()
            if rep != [b"echo", b"d", str(i).encode()]:
                raise SystemExit(f"reply {i}: {rep!r}")
        print("OK", n, flush=True)
        s.close()
    elif mode == "dealer-hold":
        import time
        s = ctx.socket(zmq.DEALER)
        s.connect(sys.argv[2])
        s.send(b"hello")
        print("SENT", flush=True)
        time.sleep(60)
    else:
        raise SystemExit(f"unknown mode {mode}")
    ctx.term()


if __name__ == "__main__":
    main()
