package serve

import (
	"os/exec"
	"strings"
	"testing"
)

// pyClient is what a Python engine's client does with pyzmq and msgpack
// (docs/engine-api.md: one DEALER, one frame per message, bin for bytes):
// hello, a malformed request, an unknown op, a bad region, then the
// session id on stdout.
const pyClient = `
import sys, zmq, msgpack
ctx = zmq.Context()
s = ctx.socket(zmq.DEALER)
s.setsockopt(zmq.RCVTIMEO, 10000)
s.connect(sys.argv[1])
def call(msg):
    s.send(msgpack.packb(msg, use_bin_type=True))
    return msgpack.unpackb(s.recv(), raw=False)
r = call({"op": "hello", "seq": 1, "version": [1, 0], "client": "py", "pid": 1})
assert r["ok"] and r["seq"] == 1 and r["version"] == [1, 0], r
assert "sglang" in r["capabilities"], r
s.send(b"\xc1")
r = msgpack.unpackb(s.recv(), raw=False)
assert r["ok"] is False and r["code"] == "bad_request" and r["seq"] is None, r
r = call({"op": "fly", "seq": 2})
assert r["code"] == "unknown_op" and r["seq"] == 2, r
r = call({"op": "register_memory", "seq": 3, "regions": [{"kind": "dram", "addr": 4096, "length": 4096, "shm": "/kvhost-py-missing"}]})
assert r["code"] == "bad_region" and "kvhost-py-missing" in r["message"], r
r = call({"op": "poll", "seq": 4, "rank": 7, "rooms": b"\x00" * 8})
assert r["code"] == "unknown", r
print(call({"op": "deregister_memory", "seq": 5, "regions": []})["ok"], flush=True)
`

// TestPythonClient: a pyzmq + msgpack client speaks the API as written
// (Debian's python3-zmq and python3-msgpack).
func TestPythonClient(t *testing.T) {
	const python = "/usr/bin/python3"
	if out, err := exec.Command(python, "-c", "import zmq, msgpack").CombinedOutput(); err != nil {
		t.Fatalf("%s with python3-zmq and python3-msgpack is needed: %v\n%s", python, err, out)
	}
	s := newTestServer(t)
	out, err := exec.Command(python, "-c", pyClient, s.Endpoint()).CombinedOutput()
	if err != nil {
		t.Fatalf("python client: %v\n%s", err, out)
	}
	if strings.TrimSpace(string(out)) != "True" {
		t.Fatalf("python client printed %q", out)
	}
}
