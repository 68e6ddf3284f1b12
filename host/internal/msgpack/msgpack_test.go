package msgpack

import (
	"bytes"
	"encoding/hex"
	"errors"
	"math"
	"runtime"
	"strings"
	"testing"
)

// Golden encodings produced by Python's msgpack.packb (which msgspec
// matches for these types).
func TestEncodeIntsLikePython(t *testing.T) {
	cases := []struct {
		v    int64
		want string
	}{
		{0, "00"}, {1, "01"}, {127, "7f"}, {128, "cc80"}, {255, "ccff"}, {256, "cd0100"},
		{65535, "cdffff"}, {65536, "ce00010000"}, {math.MaxUint32, "ceffffffff"},
		{math.MaxUint32 + 1, "cf0000000100000000"}, {-1, "ff"}, {-32, "e0"}, {-33, "d0df"},
		{-128, "d080"}, {-129, "d1ff7f"}, {-32768, "d18000"}, {-32769, "d2ffff7fff"},
		{math.MinInt32, "d280000000"}, {math.MinInt32 - 1, "d3ffffffff7fffffff"},
		{math.MinInt64, "d38000000000000000"},
	}
	for _, c := range cases {
		var e Encoder
		e.Int(c.v)
		if got := hex.EncodeToString(e.Bytes()); got != c.want {
			t.Errorf("Int(%d) = %s, want %s", c.v, got, c.want)
		}
		v, err := Decode(e.Bytes())
		if err != nil {
			t.Fatal(err)
		}
		if i, ok := v.Int(); !ok || i != c.v {
			t.Errorf("round trip of %d gave %v %v", c.v, i, ok)
		}
	}
	var e Encoder
	e.Uint(math.MaxUint64)
	if got := hex.EncodeToString(e.Bytes()); got != "cfffffffffffffffff" {
		t.Errorf("Uint(max) = %s", got)
	}
}

func TestEncodeLengthsLikePython(t *testing.T) {
	prefix := func(b []byte, n int) string { return hex.EncodeToString(b[:min(n, len(b))]) }
	for _, c := range []struct {
		n        int
		str, bin string
	}{
		{0, "a0", "c400"}, {31, "bf6161616161", "c41f61616161"}, {32, "d92061616161", "c42061616161"},
		{255, "d9ff61616161", "c4ff61616161"}, {256, "da0100616161", "c50100616161"},
		{65535, "daffff616161", "c5ffff616161"}, {65536, "db0001000061", "c60001000061"},
	} {
		var s, b Encoder
		s.Str(strings.Repeat("a", c.n))
		b.Bin(bytes.Repeat([]byte("a"), c.n))
		if got := prefix(s.Bytes(), 6); got != c.str {
			t.Errorf("Str(%d) = %s, want %s", c.n, got, c.str)
		}
		if got := prefix(b.Bytes(), 6); got != c.bin {
			t.Errorf("Bin(%d) = %s, want %s", c.n, got, c.bin)
		}
	}
	for _, c := range []struct {
		n       int
		arr, mp string
	}{{0, "90", "80"}, {15, "9f", "8f"}, {16, "dc0010", "de0010"}, {65535, "dcffff", "deffff"}, {65536, "dd00010000", "df00010000"}} {
		var a, m Encoder
		a.ArrayHeader(c.n)
		m.MapHeader(c.n)
		if got := hex.EncodeToString(a.Bytes()); got != c.arr {
			t.Errorf("ArrayHeader(%d) = %s, want %s", c.n, got, c.arr)
		}
		if got := hex.EncodeToString(m.Bytes()); got != c.mp {
			t.Errorf("MapHeader(%d) = %s, want %s", c.n, got, c.mp)
		}
	}
}

func TestDecodeStructure(t *testing.T) {
	var e Encoder
	e.MapHeader(4)
	e.Str("name")
	e.Str("x")
	e.Str("blob")
	e.Bin([]byte{1, 2})
	e.Str("list")
	e.ArrayHeader(3)
	e.Int(-5)
	e.Uint(1 << 40)
	e.Nil()
	e.Str("ok")
	e.Bool(true)
	v, err := Decode(e.Bytes())
	if err != nil {
		t.Fatal(err)
	}
	if s, _ := mustGet(t, v, "name").Str(); s != "x" {
		t.Fatalf("name %q", s)
	}
	if b, _ := mustGet(t, v, "blob").Bin(); !bytes.Equal(b, []byte{1, 2}) {
		t.Fatalf("blob %v", b)
	}
	l := mustGet(t, v, "list")
	if len(l.Items) != 3 || l.Items[2].Kind != Nil {
		t.Fatalf("list %+v", l)
	}
	if i, _ := l.Items[0].Int(); i != -5 {
		t.Fatalf("list[0] %d", i)
	}
	if u, _ := l.Items[1].Uint(); u != 1<<40 {
		t.Fatalf("list[1] %d", u)
	}
	if _, ok := l.Items[0].Uint(); ok {
		t.Fatal("negative value read as uint")
	}
	if b, ok := mustGet(t, v, "ok").Bool(); !ok || !b {
		t.Fatal("ok")
	}
	if _, ok := v.Get("missing"); ok {
		t.Fatal("missing key found")
	}
}

func mustGet(t *testing.T, v Value, k string) Value {
	t.Helper()
	x, ok := v.Get(k)
	if !ok {
		t.Fatalf("key %q missing", k)
	}
	return x
}

func TestDecodeFloatsAndExt(t *testing.T) {
	for in, want := range map[string]float64{"ca3fc00000": 1.5, "cb4004000000000000": 2.5} {
		b, _ := hex.DecodeString(in)
		v, err := Decode(b)
		if f, ok := v.Float(); err != nil || !ok || f != want {
			t.Errorf("%s: %v %v %v", in, f, ok, err)
		}
	}
	b, _ := hex.DecodeString("d6ff00000001") // fixext4, timestamp
	v, err := Decode(b)
	if err != nil || v.Kind != Ext || v.ExtType != -1 || len(v.Raw()) != 4 {
		t.Fatalf("ext: %+v %v", v, err)
	}
}

// Hostile inputs: declared lengths far beyond the input, deep nesting,
// reserved bytes, trailing bytes. All are errors; none allocates by the
// declared size.
func TestDecodeRejects(t *testing.T) {
	deep := bytes.Repeat([]byte{0x91}, MaxDepth+2)
	deep = append(deep, 0)
	for name, in := range map[string]string{
		"array32 of 4G":  "ddffffffff",
		"map32 of 4G":    "dfffffffff00",
		"bin32 of 4G":    "c6ffffffff",
		"str past end":   "a5616263",
		"reserved c1":    "c1",
		"trailing bytes": "0000",
		"empty":          "",
		"truncated int":  "cd01",
		"ext past end":   "c7ff01",
	} {
		b, _ := hex.DecodeString(in)
		if _, err := Decode(b); !errors.Is(err, ErrMalformed) {
			t.Errorf("%s: %v, want ErrMalformed", name, err)
		}
	}
	if _, err := Decode(deep); !errors.Is(err, ErrMalformed) {
		t.Errorf("deep nesting: %v", err)
	}
}

// A message of n one-byte elements would build n Values of about 110
// bytes each: the value budget refuses it before allocating, whether the
// elements sit in one array or are spread over many, and a message within
// the budget still decodes.
func TestDecodeValueBudget(t *testing.T) {
	array := func(n int, elem []byte) []byte {
		b := []byte{0xdd, byte(n >> 24), byte(n >> 16), byte(n >> 8), byte(n)}
		for range n {
			b = append(b, elem...)
		}
		return b
	}
	if v, err := Decode(array(MaxValues, []byte{1})); err != nil || len(v.Items) != MaxValues {
		t.Fatalf("array of MaxValues: %d items, %v", len(v.Items), err)
	}
	huge := array(1<<20, []byte{1})
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	_, err := Decode(huge)
	runtime.ReadMemStats(&after)
	if !errors.Is(err, ErrMalformed) {
		t.Fatalf("array of 2^20 elements: %v, want ErrMalformed", err)
	}
	if got := after.TotalAlloc - before.TotalAlloc; got > 1<<20 {
		t.Fatalf("refusing a %d-byte message allocated %d bytes", len(huge), got)
	}
	// The same budget across nested containers: 2^10 arrays of 2^7
	// elements each, and maps, whose keys and values both count.
	nested := array(1<<10, append([]byte{0xdc, 0, 1 << 7}, bytes.Repeat([]byte{0}, 1<<7)...))
	if _, err := Decode(nested); !errors.Is(err, ErrMalformed) {
		t.Fatalf("nested arrays over the budget: %v", err)
	}
	m := []byte{0xdf, 0, 0, 0x80, 0} // map32 of 2^15 pairs: 2^16 values
	for range 1 << 15 {
		m = append(m, 0, 0)
	}
	if _, err := Decode(m); err != nil {
		t.Fatalf("map of MaxValues keys and values: %v", err)
	}
	m[3] = 0x80
	m[4] = 1
	m = append(m, 0, 0)
	if _, err := Decode(m); !errors.Is(err, ErrMalformed) {
		t.Fatalf("map over the budget: %v", err)
	}
}

// Floats are packed as msgpack-python packs a Python float: always the
// 9-byte form.
func TestEncodeFloatLikePython(t *testing.T) {
	for f, want := range map[float64]string{1.5: "cb3ff8000000000000", math.Copysign(0, -1): "cb8000000000000000", math.Inf(1): "cb7ff0000000000000"} {
		var e Encoder
		e.Float(f)
		if got := hex.EncodeToString(e.Bytes()); got != want {
			t.Errorf("Float(%v) = %s, want %s", f, got, want)
		}
		v, err := Decode(e.Bytes())
		if g, ok := v.Float(); err != nil || !ok || math.Float64bits(g) != math.Float64bits(f) {
			t.Errorf("round trip of %v gave %v %v %v", f, g, ok, err)
		}
	}
}

// A control message as msgpack.packb({'op': 'send', 'pages': [1, 2],
// 't': 0.25}) writes it, read through Len, Index and Each, and the same
// message encoded by an Encoder.
func TestIterateControlMessage(t *testing.T) {
	golden, _ := hex.DecodeString("83a26f70a473656e64a57061676573920102a174cb3fd0000000000000")
	var e Encoder
	e.MapHeader(3)
	e.Str("op")
	e.Str("send")
	e.Str("pages")
	e.ArrayHeader(2)
	e.Int(1)
	e.Int(2)
	e.Str("t")
	e.Float(0.25)
	if !bytes.Equal(e.Bytes(), golden) {
		t.Fatalf("encoded %x, want %x", e.Bytes(), golden)
	}
	v, err := Decode(golden)
	if err != nil {
		t.Fatal(err)
	}
	if v.Len() != 3 {
		t.Fatalf("map Len %d", v.Len())
	}
	var keys []string
	err = v.Each(func(k string, val Value) bool {
		keys = append(keys, strings.Clone(k))
		switch k {
		case "op":
			if s, _ := val.Str(); s != "send" || val.Len() != 4 {
				t.Errorf("op %q len %d", s, val.Len())
			}
		case "pages":
			if val.Len() != 2 {
				t.Errorf("pages len %d", val.Len())
			}
			for i := range val.Len() {
				x, ok := val.Index(i)
				if n, _ := x.Int(); !ok || n != int64(i+1) {
					t.Errorf("pages[%d] = %v %v", i, n, ok)
				}
			}
			if _, ok := val.Index(2); ok {
				t.Error("Index past the end succeeded")
			}
			if _, ok := val.Index(-1); ok {
				t.Error("Index(-1) succeeded")
			}
		case "t":
			if f, _ := val.Float(); f != 0.25 {
				t.Errorf("t %v", f)
			}
		}
		return true
	})
	if err != nil || strings.Join(keys, ",") != "op,pages,t" {
		t.Fatalf("Each visited %v, %v", keys, err)
	}
	// fn returning false stops the walk.
	n := 0
	if err := v.Each(func(string, Value) bool { n++; return false }); err != nil || n != 1 {
		t.Fatalf("stopped Each: %d calls, %v", n, err)
	}
	// Index and Each on the wrong kinds.
	if _, ok := v.Index(0); ok {
		t.Error("Index on a map succeeded")
	}
	pages, _ := v.Get("pages")
	if err := pages.Each(func(string, Value) bool { t.Error("fn called"); return true }); !errors.Is(err, ErrType) {
		t.Errorf("Each on an array: %v", err)
	}
	for _, k := range []Value{{Kind: Nil}, {Kind: Bool}, {Kind: Uint}, {Kind: Float}} {
		if k.Len() != 0 {
			t.Errorf("Len of %s = %d", k.Kind, k.Len())
		}
	}
}

// A map with a key that is not a string is refused whole: fn is never
// called, even for the string keys before it.
func TestEachRefusesNonStringKeys(t *testing.T) {
	b, _ := hex.DecodeString("82a16101c402616202") // {'a': 1, b'ab': 2}
	v, err := Decode(b)
	if err != nil {
		t.Fatal(err)
	}
	called := false
	err = v.Each(func(string, Value) bool { called = true; return true })
	if !errors.Is(err, ErrType) || called || !strings.Contains(err.Error(), "map key 1 is bin") {
		t.Fatalf("Each: %v, fn called %v", err, called)
	}
	if x, ok := v.Get("a"); !ok || x.Len() != 0 {
		t.Fatal("Get of the string key failed")
	}
}

// Reading a decoded control message and encoding a reply into a reused
// Encoder allocate nothing.
func TestReadAndEncodeAllocateNothing(t *testing.T) {
	golden, _ := hex.DecodeString("83a26f70a473656e64a57061676573920102a174cb3fd0000000000000")
	v, err := Decode(golden)
	if err != nil {
		t.Fatal(err)
	}
	var e Encoder
	sum := 0
	allocs := testing.AllocsPerRun(100, func() {
		if x, ok := v.Get("pages"); ok {
			for i := range x.Len() {
				y, _ := x.Index(i)
				n, _ := y.Int()
				sum += int(n)
			}
		}
		_ = v.Each(func(k string, _ Value) bool { sum += len(k); return true })
		e.Reset()
		e.MapHeader(2)
		e.Str("status")
		e.Int(0)
		e.Str("t")
		e.Float(1.5)
		e.Bin(golden)
	})
	if allocs != 0 {
		t.Fatalf("%v allocations per read and reply", allocs)
	}
}

func FuzzDecode(f *testing.F) {
	var e Encoder
	e.ArrayHeader(2)
	e.Bin([]byte("get_meta_msg"))
	e.Int(3)
	f.Add(e.Bytes())
	f.Add([]byte{0xdd, 0xff, 0xff, 0xff, 0xff})
	f.Add([]byte{0x81, 0xa1, 'k', 0x92, 0xc0, 0xc3})
	f.Fuzz(func(t *testing.T, b []byte) {
		v, err := Decode(b)
		if err != nil {
			return
		}
		// Decoding must not panic, and the tree it builds can be walked.
		if n := walk(v); n > len(b) || n > MaxValues+1 {
			t.Fatalf("%d values from %d bytes", n, len(b))
		}
		// Re-encoding the tree and decoding it again gives the same
		// values (the forms may shrink: the encoder picks the smallest).
		var e Encoder
		e.Value(v)
		w, err := Decode(e.Bytes())
		if err != nil {
			t.Fatalf("re-encoded %x: %v", e.Bytes(), err)
		}
		if !same(v, w) {
			t.Fatalf("re-encoding %x gave %x", b, e.Bytes())
		}
	})
}

// walk counts the values of a tree through Len, Index and Each, checking
// that they agree with each other.
func walk(v Value) int {
	n := 1
	switch v.Kind {
	case Array:
		for i := range v.Len() {
			x, ok := v.Index(i)
			if !ok {
				panic("Index within Len failed")
			}
			n += walk(x)
		}
		if _, ok := v.Index(v.Len()); ok {
			panic("Index at Len succeeded")
		}
	case Map:
		strKeys := true
		for _, p := range v.Pairs {
			n += walk(p[0]) + walk(p[1])
			strKeys = strKeys && p[0].Kind == Str
		}
		seen := 0
		err := v.Each(func(k string, val Value) bool {
			if g, ok := v.Get(k); !ok || !dupKey(v, k) && !same(g, val) {
				panic("Get of a visited key failed")
			}
			seen++
			return true
		})
		if strKeys != (err == nil) || strKeys && seen != v.Len() {
			panic("Each disagrees with the keys")
		}
	}
	return n
}

func dupKey(v Value, k string) bool {
	c := 0
	for _, p := range v.Pairs {
		if s, ok := p[0].Str(); ok && s == k {
			c++
		}
	}
	return c > 1
}

// same compares two trees by value: an integer is the same whether it was
// encoded signed or unsigned, floats by their bits.
func same(a, b Value) bool {
	if ai, ok := a.Int(); ok {
		bi, ok := b.Int()
		return ok && ai == bi
	}
	if au, ok := a.Uint(); ok {
		bu, ok := b.Uint()
		return ok && au == bu
	}
	if a.Kind != b.Kind || a.Len() != b.Len() || a.ExtType != b.ExtType || !bytes.Equal(a.Raw(), b.Raw()) {
		return false
	}
	switch a.Kind {
	case Bool:
		return a.b == b.b
	case Float:
		return math.Float64bits(a.f) == math.Float64bits(b.f)
	case Array:
		for i := range a.Items {
			if !same(a.Items[i], b.Items[i]) {
				return false
			}
		}
	case Map:
		for i := range a.Pairs {
			if !same(a.Pairs[i][0], b.Pairs[i][0]) || !same(a.Pairs[i][1], b.Pairs[i][1]) {
				return false
			}
		}
	}
	return true
}
