package zmq

import (
	"fmt"
	"net"
	"strconv"
	"strings"
)

// TCPEndpoint formats a ZeroMQ TCP endpoint, bracketing IPv6 hosts:
// TCPEndpoint("10.0.0.1", 5000) is "tcp://10.0.0.1:5000",
// TCPEndpoint("::1", 5000) is "tcp://[::1]:5000". This is the form SGLang
// builds from a bootstrap entry's rank_ip and rank_port.
func TCPEndpoint(host string, port int) string {
	return "tcp://" + net.JoinHostPort(host, strconv.Itoa(port))
}

// IPCEndpoint formats a ZeroMQ ipc endpoint for a unix-domain socket:
// IPCEndpoint("/run/kvhost/engine.sock") is "ipc:///run/kvhost/engine.sock",
// and a name starting with "@" is an abstract socket (Linux), as in libzmq.
func IPCEndpoint(path string) string { return "ipc://" + path }

// maxIPCPath is the longest path a unix-domain socket address holds
// (sun_path is 108 bytes with its terminating NUL on Linux).
const maxIPCPath = 107

// address is where an endpoint lives, in net.Dial and net.Listen terms.
type address struct {
	network string // "tcp" or "unix"
	addr    string // "host:port", a socket path, or "@name" (abstract)
}

// abstract reports an abstract unix socket (no file; Linux only).
func (a address) abstract() bool { return a.network == "unix" && strings.HasPrefix(a.addr, "@") }

// parseEndpoint turns "tcp://host:port" or "ipc://path" into an address.
// ipc endpoints are unix-domain stream sockets, as libzmq's ipc transport:
// everything after "ipc://" is the socket's path (relative paths are
// relative to the working directory), and "ipc://@name" is the abstract
// socket name (Linux). libzmq's "ipc://*" (a generated name) is not
// supported: the control socket's path is configured, never generated.
func parseEndpoint(endpoint string, bind bool) (address, error) {
	if path, ok := strings.CutPrefix(endpoint, "ipc://"); ok {
		switch {
		case path == "" || path == "@":
			return address{}, fmt.Errorf("zmq: endpoint %q: ipc needs a socket path", endpoint)
		case path == "*":
			return address{}, fmt.Errorf("zmq: endpoint %q: generated ipc names are not supported; give a path", endpoint)
		case len(path) > maxIPCPath:
			return address{}, fmt.Errorf("zmq: endpoint %q: socket path of %d bytes (at most %d)", endpoint, len(path), maxIPCPath)
		case strings.IndexByte(path, 0) >= 0:
			return address{}, fmt.Errorf("zmq: endpoint %q: NUL byte in the socket path", endpoint)
		}
		return address{network: "unix", addr: path}, nil
	}
	addr, err := tcpAddress(endpoint, bind)
	if err != nil {
		return address{}, err
	}
	return address{network: "tcp", addr: addr}, nil
}

// tcpAddress turns "tcp://host:port" into "host:port" for net.Dial and
// net.Listen. For binding, "*" as host means every interface (libzmq's
// spelling), and port 0 picks a free port.
func tcpAddress(endpoint string, bind bool) (string, error) {
	rest, ok := strings.CutPrefix(endpoint, "tcp://")
	if !ok {
		return "", fmt.Errorf("zmq: endpoint %q: only tcp:// and ipc:// endpoints are supported", endpoint)
	}
	host, port, err := net.SplitHostPort(rest)
	if err != nil {
		return "", fmt.Errorf("zmq: endpoint %q: %w", endpoint, err)
	}
	p, err := strconv.Atoi(port)
	if err != nil || p < 0 || p > 65535 {
		return "", fmt.Errorf("zmq: endpoint %q: bad port %q", endpoint, port)
	}
	if host == "*" {
		if !bind {
			return "", fmt.Errorf("zmq: endpoint %q: cannot connect to host *", endpoint)
		}
		host = ""
	}
	if !bind && (host == "" || p == 0) {
		return "", fmt.Errorf("zmq: endpoint %q: connect needs a host and a non-zero port", endpoint)
	}
	return net.JoinHostPort(host, strconv.Itoa(p)), nil
}

// endpointOf formats a listener address as a connectable endpoint.
func endpointOf(a net.Addr) string {
	switch a := a.(type) {
	case *net.TCPAddr:
		return TCPEndpoint(a.IP.String(), a.Port)
	case *net.UnixAddr:
		return IPCEndpoint(a.Name)
	}
	return "tcp://" + a.String()
}

// portOf is the TCP port of a listener address, 0 for other transports.
func portOf(a net.Addr) int {
	if ta, ok := a.(*net.TCPAddr); ok {
		return ta.Port
	}
	return 0
}
