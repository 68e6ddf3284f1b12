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

// tcpAddress turns "tcp://host:port" into "host:port" for net.Dial and
// net.Listen. For binding, "*" as host means every interface (libzmq's
// spelling), and port 0 picks a free port.
func tcpAddress(endpoint string, bind bool) (string, error) {
	rest, ok := strings.CutPrefix(endpoint, "tcp://")
	if !ok {
		return "", fmt.Errorf("zmq: endpoint %q: only tcp:// endpoints are supported", endpoint)
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
	if ta, ok := a.(*net.TCPAddr); ok {
		return TCPEndpoint(ta.IP.String(), ta.Port)
	}
	return "tcp://" + a.String()
}
