package zmqtest

import (
	"bufio"
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"strings"
	"testing"
	"time"
)

// Raw is a ZMTP 3.1 peer driven by hand, for tests that need a peer to
// misbehave in ways a real socket will not: pipeline requests on a REQ
// connection, never read, send odd frame counts. It is written
// independently of package zmq (from the ZMTP spec), so it also checks
// that package against the wire format rather than against itself.
type Raw struct {
	net.Conn
	r *bufio.Reader
}

// DialRaw connects to endpoint ("tcp://host:port" or "ipc://path") and completes the
// NULL-mechanism handshake as a socket of type socketType ("REQ", "PUSH",
// "DEALER"...). The connection is closed when the test ends.
func DialRaw(t testing.TB, endpoint, socketType string) *Raw {
	t.Helper()
	return DialRawFrom(t, endpoint, socketType, "")
}

// DialRawFrom is DialRaw from the local IP localIP ("" lets the system
// choose): on one machine, a peer from 127.0.0.2 stands for another host.
func DialRawFrom(t testing.TB, endpoint, socketType, localIP string) *Raw {
	t.Helper()
	p, err := TryDialRaw(endpoint, socketType, localIP)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	return p
}

// TryDialRaw is DialRaw from the local IP address localIP (empty: any),
// returning an error instead of failing the test; the caller closes the
// connection.
func TryDialRaw(endpoint, socketType, localIP string) (*Raw, error) {
	d := net.Dialer{Timeout: 10 * time.Second}
	if localIP != "" {
		d.LocalAddr = &net.TCPAddr{IP: net.ParseIP(localIP)}
	}
	network, addr := "tcp", strings.TrimPrefix(endpoint, "tcp://")
	if path, ok := strings.CutPrefix(endpoint, "ipc://"); ok {
		network, addr = "unix", path
	}
	nc, err := d.Dial(network, addr)
	if err != nil {
		return nil, fmt.Errorf("zmqtest: dial %s: %w", endpoint, err)
	}
	p := &Raw{Conn: nc, r: bufio.NewReader(nc)}
	if err := p.handshake(socketType); err != nil {
		nc.Close()
		return nil, err
	}
	return p, nil
}

func (p *Raw) handshake(socketType string) error {
	p.SetDeadline(time.Now().Add(10 * time.Second))
	defer p.SetDeadline(time.Time{})
	greeting := make([]byte, 64)
	greeting[0], greeting[9], greeting[10], greeting[11] = 0xFF, 0x7F, 3, 1
	copy(greeting[12:], "NULL")
	if _, err := p.Write(greeting); err != nil {
		return fmt.Errorf("zmqtest: greeting: %w", err)
	}
	var ready []byte
	ready = append(ready, 5)
	ready = append(ready, "READY"...)
	ready = append(ready, byte(len("Socket-Type")))
	ready = append(ready, "Socket-Type"...)
	ready = binary.BigEndian.AppendUint32(ready, uint32(len(socketType)))
	ready = append(ready, socketType...)
	if _, err := p.Write(frame(0x04, ready)); err != nil {
		return fmt.Errorf("zmqtest: READY: %w", err)
	}
	if _, err := io.ReadFull(p.r, make([]byte, 64)); err != nil {
		return fmt.Errorf("zmqtest: reading the greeting: %w", err)
	}
	flags, body, err := p.readFrame()
	if err != nil || flags&0x04 == 0 || len(body) < 6 || string(body[1:6]) != "READY" {
		return fmt.Errorf("zmqtest: want READY, got flags %#x %q %v", flags, body, err)
	}
	return nil
}

// frame encodes one frame with the given flags (MORE 0x01, COMMAND 0x04;
// LONG is added as needed).
func frame(flags byte, body []byte) []byte {
	if len(body) > 255 {
		return append(binary.BigEndian.AppendUint64([]byte{flags | 0x02}, uint64(len(body))), body...)
	}
	return append([]byte{flags, byte(len(body))}, body...)
}

// EncodeMessage returns the wire bytes of a multipart message.
func EncodeMessage(frames ...[]byte) []byte {
	var b []byte
	for i, f := range frames {
		var flags byte
		if i < len(frames)-1 {
			flags = 0x01
		}
		b = append(b, frame(flags, f)...)
	}
	return b
}

// Send writes one multipart message.
func (p *Raw) Send(frames ...[]byte) error {
	_, err := p.Write(EncodeMessage(frames...))
	return err
}

// Recv reads the next message, skipping commands (PING and the like).
func (p *Raw) Recv() ([][]byte, error) {
	var msg [][]byte
	for {
		flags, body, err := p.readFrame()
		if err != nil {
			return nil, err
		}
		if flags&0x04 != 0 {
			continue
		}
		msg = append(msg, body)
		if flags&0x01 == 0 {
			return msg, nil
		}
	}
}

func (p *Raw) readFrame() (byte, []byte, error) {
	flags, err := p.r.ReadByte()
	if err != nil {
		return 0, nil, err
	}
	var size uint64
	if flags&0x02 != 0 {
		var b [8]byte
		if _, err := io.ReadFull(p.r, b[:]); err != nil {
			return 0, nil, err
		}
		size = binary.BigEndian.Uint64(b[:])
	} else {
		b, err := p.r.ReadByte()
		if err != nil {
			return 0, nil, err
		}
		size = uint64(b)
	}
	if size > 1<<30 {
		return 0, nil, fmt.Errorf("zmqtest: frame of %d bytes", size)
	}
	body := make([]byte, size)
	_, err = io.ReadFull(p.r, body)
	return flags, body, err
}
