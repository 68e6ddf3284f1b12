package serve

import (
	"errors"
	"fmt"
	"regexp"
	"strconv"
	"strings"

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

// hexAddr matches the addresses fault messages name (the plugin's, and
// host/internal/memfault's): addresses of the sidecar's mappings.
var hexAddr = regexp.MustCompile(`0x[0-9a-f]+`)

// engineTerms adds to a failure reason that says memory went away under
// the sidecar (its shared memory shrank or was unmapped) where that is in
// the engine's terms: the first address it names that lies in one of this
// connection's regions, as the engine's own pointer, with the region and
// its shm. The engine does not know the sidecar's addresses. Other
// reasons are returned as they are.
func (m *memTable) engineTerms(reason string) string {
	if !strings.Contains(reason, "mapped") {
		return reason
	}
	regs := m.t.Regions()
	for _, s := range hexAddr.FindAllString(reason, 8) {
		a, err := strconv.ParseUint(s[2:], 16, 64)
		if err != nil {
			continue
		}
		for _, r := range regs {
			if r.Kind == engmem.DRAM && a >= uint64(r.Local) && a-uint64(r.Local) < r.Length {
				return fmt.Sprintf("%s [in this engine's terms: %s is engine address %#x in region %d (engine range [%#x, +%d), shm %q at offset %d), "+
					"which the engine must not shrink while it is registered]",
					reason, s, r.Addr+(a-uint64(r.Local)), r.ID, r.Addr, r.Length, r.SHM, r.Offset)
			}
		}
	}
	return reason
}
