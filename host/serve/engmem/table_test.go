package engmem

import (
	"fmt"
	"sync"
	"testing"

	"pgregory.net/rapid"
)

func dram(addr, length uint64, shm string, offset uint64) Spec {
	return Spec{Kind: DRAM, Addr: addr, Length: length, SHM: shm, Offset: offset}
}

// TestTableOverlap: overlapping ranges are refused within one Add and
// across Adds, naming both ranges; the refused Add leaves the Table and
// the mappings as they were. Adjacent ranges are not an overlap.
func TestTableOverlap(t *testing.T) {
	name, path := newSHM(t, 4*page)
	tb := NewTable(nil)
	defer tb.Close()
	rs, err := tb.Add([]Spec{dram(0x10000, page, name, 0), dram(0x10000+page, page, name, page)})
	if err != nil {
		t.Fatal(err)
	}
	if len(rs) != 2 || rs[0].ID == 0 || rs[0].ID == rs[1].ID || tb.Len() != 2 {
		t.Fatalf("regions %+v, Len %d", rs, tb.Len())
	}
	base := mapsOf(t, path)

	_, err = tb.Add([]Spec{dram(0x40000, page, name, 0), dram(0x40000+page-1, 2, name, 0)})
	wantCode(t, err, CodeBadRegion, "regions[1] [0x40fff, 0x41001) overlaps regions[0] [0x40000, 0x41000)")
	_, err = tb.Add([]Spec{dram(0x40000, page, name, 0), dram(0x10000+page-1, 1, name, 0)})
	wantCode(t, err, CodeBadRegion, "regions[1] [0x10fff, 0x11000) overlaps region", "[0x10000, 0x11000)")
	_, err = tb.Add([]Spec{dram(0x8000, 0x10000, name, 0)}) // covers the first region's start
	wantCode(t, err, CodeBadRegion, "overlaps region", "[0x10000, 0x11000)")
	_, err = tb.Add([]Spec{dram(0x10000, 2*page, name, 0)}) // the same two ranges at once
	wantCode(t, err, CodeBadRegion, "overlaps")
	_, err = tb.Add([]Spec{dram(0x40000, page, name, 0), dram(0x50000, 8*page, name, 0)}) // short: opened one is closed
	wantCode(t, err, CodeBadRegion, "regions[1]", "past the end")
	if tb.Len() != 2 || mapsOf(t, path) != base {
		t.Fatalf("Len %d, mappings %d (want 2, %d) after refusals", tb.Len(), mapsOf(t, path), base)
	}
	if _, err := tb.Add([]Spec{dram(0x10000+2*page, page, name, 0), dram(0x10000-page, page, name, 0)}); err != nil {
		t.Fatalf("adjacent on both sides: %v", err)
	}
}

// TestTableRemoveCloseRelease: Remove and Close unmap what they drop
// (counted in /proc/self/maps); an unknown id removes nothing.
func TestTableRemoveCloseRelease(t *testing.T) {
	name, path := newSHM(t, 4*page)
	before := mapsOf(t, path)
	tb := NewTable(&Opener{})
	var specs []Spec
	for i := range uint64(8) {
		specs = append(specs, dram(0x100000+i*0x10000, page+i, name, i*100))
	}
	rs, err := tb.Add(specs)
	if err != nil {
		t.Fatal(err)
	}
	if n := mapsOf(t, path) - before; n != 8 {
		t.Fatalf("%d mappings after Add, want 8", n)
	}
	err = tb.Remove([]uint64{rs[0].ID, 999})
	wantCode(t, err, CodeUnknown, "region 999")
	if tb.Len() != 8 || mapsOf(t, path)-before != 8 {
		t.Fatal("a refused Remove removed something")
	}
	if err := tb.Remove([]uint64{rs[0].ID, rs[3].ID, rs[3].ID}); err != nil {
		t.Fatal(err)
	}
	if n := mapsOf(t, path) - before; n != 6 || tb.Len() != 6 {
		t.Fatalf("%d mappings, Len %d after removing 2, want 6", n, tb.Len())
	}
	if _, _, err := tb.Translate(rs[0].Addr, 1); err == nil {
		t.Fatal("a removed region still translates")
	}
	if tb.Region(rs[3].ID) != nil || tb.Region(rs[4].ID) != rs[4] || len(tb.Regions()) != 6 {
		t.Fatal("Region/Regions disagree with Remove")
	}
	err = tb.Remove([]uint64{rs[0].ID})
	wantCode(t, err, CodeUnknown)
	if err := tb.Close(); err != nil {
		t.Fatal(err)
	}
	if n := mapsOf(t, path) - before; n != 0 || tb.Len() != 0 {
		t.Fatalf("%d mappings, Len %d after Close", n, tb.Len())
	}
	if err := tb.Close(); err != nil {
		t.Fatal("second Close:", err)
	}
	_, err = tb.Add(specs[:1])
	wantCode(t, err, CodeBadRegion, "released")
	if n := mapsOf(t, path) - before; n != 0 {
		t.Fatalf("Add after Close left %d mappings", n)
	}
}

// TestTableLimit: a Table holds at most MaxRegions regions.
func TestTableLimit(t *testing.T) {
	name, path := newSHM(t, page)
	tb := NewTable(nil)
	defer tb.Close()
	specs := make([]Spec, MaxRegions+1)
	for i := range specs {
		specs[i] = dram(uint64(i+1)*page, page, name, 0)
	}
	_, err := tb.Add(specs)
	wantCode(t, err, CodeLimit, fmt.Sprint(MaxRegions))
	if _, err := tb.Add(specs[:MaxRegions]); err != nil {
		t.Fatal(err)
	}
	_, err = tb.Add(specs[MaxRegions:])
	wantCode(t, err, CodeLimit, fmt.Sprint(MaxRegions))
	if tb.Len() != MaxRegions {
		t.Fatal(tb.Len())
	}
	tb.Close()
	if n := mapsOf(t, path); n != 0 {
		t.Fatalf("%d mappings left", n)
	}
}

// TestTranslateBoundaries: ranges at a region's ends, past them, across
// two adjacent regions and in gaps.
func TestTranslateBoundaries(t *testing.T) {
	name, _ := newSHM(t, 4*page)
	tb := NewTable(nil)
	defer tb.Close()
	// A [0x10000, 0x11000) and B [0x11000, 0x11100) adjacent; C after a gap.
	rs, err := tb.Add([]Spec{dram(0x10000, page, name, 0), dram(0x11000, 0x100, name, 2*page+5), dram(0x20000, 0x10, name, 3*page)})
	if err != nil {
		t.Fatal(err)
	}
	A, B, C := rs[0], rs[1], rs[2]
	for _, tc := range []struct {
		addr, length uint64
		r            *Region
	}{
		{0x10000, page, A},
		{0x10000, 0, A},
		{0x10fff, 1, A},
		{0x10fff, 0, A},
		{0x11000, 0x100, B},
		{0x11000, 0, B},
		{0x110ff, 1, B},
		{0x20000, 0x10, C},
		{0x10fff, 2, nil}, // across A and B
		{0x10000, page + 1, nil},
		{0x110ff, 2, nil}, // past B's end
		{0x11100, 0, nil}, // B's end
		{0x11100, 1, nil}, // the gap
		{0xffff, 1, nil},  // before A
		{0xffff, 2, nil},  // into A from below
		{0x20010, 0, nil}, // C's end
		{0x1fff0, 0x20, nil},
		{1<<64 - 1, 2, nil}, // wraps
		{0, 0, nil},
	} {
		local, r, err := tb.Translate(tc.addr, tc.length)
		if tc.r == nil {
			if err == nil {
				t.Errorf("[0x%x +%d) translated to region %d", tc.addr, tc.length, r.ID)
				continue
			}
			wantCode(t, err, CodeBadRegion, fmt.Sprintf("0x%x", tc.addr))
			continue
		}
		if err != nil || r != tc.r || local != r.Local+uintptr(tc.addr-r.Addr) {
			t.Errorf("[0x%x +%d): local 0x%x region %v err %v", tc.addr, tc.length, local, r, err)
			continue
		}
		b, err := tb.Bytes(tc.addr, tc.length)
		if err != nil || uint64(len(b)) != tc.length || uint64(cap(b)) != tc.length {
			t.Errorf("Bytes [0x%x +%d): len %d cap %d err %v", tc.addr, tc.length, len(b), cap(b), err)
		}
	}
}

// TestTranslateModel: random layouts of regions (adjacent or apart,
// random offsets into one shm object) and random ranges agree with a
// plain scan, and Bytes reads the file's bytes at the translated offset.
func TestTranslateModel(t *testing.T) {
	const size = 16 * page
	name, path := newSHM(t, size)
	rapid.Check(t, func(rt *rapid.T) {
		tb := NewTable(nil)
		defer tb.Close()
		n := rapid.IntRange(1, 8).Draw(rt, "regions")
		var specs []Spec
		addr := rapid.Uint64Range(0x1000, 1<<40).Draw(rt, "base")
		for i := range n {
			addr += rapid.Uint64Range(0, 3).Draw(rt, fmt.Sprint("gap", i)) * 0x100
			length := rapid.Uint64Range(1, 2*page).Draw(rt, fmt.Sprint("len", i))
			off := rapid.Uint64Range(0, size-length).Draw(rt, fmt.Sprint("off", i))
			specs = append(specs, dram(addr, length, name, off))
			addr += length
		}
		if _, err := tb.Add(specs); err != nil {
			rt.Fatal(err)
		}
		lo, hi := specs[0].Addr-0x200, addr+0x200
		for q := range 50 {
			a := rapid.Uint64Range(lo, hi).Draw(rt, fmt.Sprint("a", q))
			l := rapid.Uint64Range(0, 3*page).Draw(rt, fmt.Sprint("l", q))
			var want *Spec
			for i := range specs {
				s := &specs[i]
				if a >= s.Addr && a < s.Addr+s.Length && a+l <= s.Addr+s.Length {
					want = s
				}
			}
			local, r, err := tb.Translate(a, l)
			if want == nil {
				if err == nil {
					rt.Fatalf("[0x%x +%d) translated to region at 0x%x", a, l, r.Addr)
				}
				continue
			}
			if err != nil {
				rt.Fatalf("[0x%x +%d): %v", a, l, err)
			}
			if r.Addr != want.Addr || local != r.Local+uintptr(a-r.Addr) {
				rt.Fatalf("[0x%x +%d): region at 0x%x local 0x%x", a, l, r.Addr, local)
			}
			b, err := tb.Bytes(a, l)
			if err != nil {
				rt.Fatal(err)
			}
			if l > 0 {
				file, _ := readAt(path, int64(want.Offset+a-want.Addr), int(l))
				if string(b) != string(file) {
					rt.Fatalf("[0x%x +%d): Bytes differ from the file", a, l)
				}
			}
		}
	})
}

// TestTableConcurrent: Translate while other goroutines Add and Remove
// (run with -race).
func TestTableConcurrent(t *testing.T) {
	name, path := newSHM(t, page)
	tb := NewTable(nil)
	if _, err := tb.Add([]Spec{dram(0x1000, page, name, 0)}); err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	for g := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 100 {
				addr := uint64(0x100000*(g+1) + i*0x1000)
				rs, err := tb.Add([]Spec{dram(addr, 16, name, 0)})
				if err != nil {
					t.Error(err)
					return
				}
				if b, err := tb.Bytes(addr, 16); err != nil || len(b) != 16 {
					t.Error(err)
					return
				}
				if b, err := tb.Bytes(0x1000, page); err != nil || b[0] != rs[0].Bytes[0] {
					t.Error(err)
					return
				}
				if err := tb.Remove([]uint64{rs[0].ID}); err != nil {
					t.Error(err)
					return
				}
			}
		}()
	}
	wg.Wait()
	if tb.Len() != 1 {
		t.Fatal(tb.Len())
	}
	tb.Close()
	if n := mapsOf(t, path); n != 0 {
		t.Fatalf("%d mappings left", n)
	}
}

// TestTableTranslateDuringRemove: Bytes and Translate of a range whose
// region another goroutine is removing read no field Remove writes (run
// with -race). The slices are not used: the caller's contract forbids
// using a region being removed; reading the table must still be clean.
func TestTableTranslateDuringRemove(t *testing.T) {
	name, _ := newSHM(t, page)
	tb := NewTable(nil)
	defer tb.Close()
	done := make(chan struct{})
	go func() {
		defer close(done)
		for range 300 {
			rs, err := tb.Add([]Spec{dram(0x1000, page, name, 0)})
			if err != nil {
				t.Error(err)
				return
			}
			if err := tb.Remove([]uint64{rs[0].ID}); err != nil {
				t.Error(err)
				return
			}
		}
	}()
	var hits int
	for {
		select {
		case <-done:
			t.Logf("%d translations while regions came and went", hits)
			return
		default:
		}
		if b, err := tb.Bytes(0x1000, 16); err == nil && len(b) == 16 {
			hits++
		}
		if _, r, err := tb.Translate(0x1000, 16); err == nil && r.Bytes == nil {
			t.Fatal("a region in the table has no mapping")
		}
	}
}
