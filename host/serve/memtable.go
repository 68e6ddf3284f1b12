package serve

import (
	"errors"

	"github.com/kvhost/kvhost/host/serve/engmem"
)

// memRegion is one registered region (host/serve/engmem).
type memRegion = engmem.Region

// memTable is one connection's regions: an engmem.Table whose errors are
// the API's.
type memTable struct{ t *engmem.Table }

func newMemTable(o *engmem.Opener) *memTable { return &memTable{t: engmem.NewTable(o)} }

// memError turns engmem's errors into the API's.
func memError(err error) error {
	if err == nil {
		return nil
	}
	var e *engmem.Error
	if errors.As(err, &e) {
		return &Error{Code: e.Code, Message: e.Msg}
	}
	return errorf(CodeBadRegion, "%v", err)
}

// add opens every spec or none.
func (m *memTable) add(specs []engmem.Spec) ([]*memRegion, error) {
	rs, err := m.t.Add(specs)
	return rs, memError(err)
}

// translate maps an engine pointer range to the sidecar's address.
func (m *memTable) translate(addr, length uint64) (uintptr, *memRegion, error) {
	p, r, err := m.t.Translate(addr, length)
	return p, r, memError(err)
}

// bytes returns the sidecar's mapping of a DRAM range.
func (m *memTable) bytes(addr, length uint64) ([]byte, error) {
	b, err := m.t.Bytes(addr, length)
	return b, memError(err)
}

func (m *memTable) byID(id uint64) *memRegion { return m.t.Region(id) }

func (m *memTable) remove(ids []uint64) error { return memError(m.t.Remove(ids)) }

func (m *memTable) len() int { return m.t.Len() }

func (m *memTable) close() { m.t.Close() }
