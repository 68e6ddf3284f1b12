package vllm

import (
	"encoding/hex"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"
	"unicode"

	"github.com/kvhost/kvhost/host/internal/zmq/zmqtest"
)

// peerScript is the Python peer of the codec tests (and of host/pull's
// handshake tests).
const peerScript = "testdata/vllm_peer.py"

// notifCases are notifications with what vLLM's kv_connector/v1/nixl_connector.py makes of them:
// ok false where _get_new_notifs raises (or, for counts that are not
// positive ints, where it would count a notification it never releases on).
var notifCases = []struct {
	in    string
	id    string
	ratio int
	ok    bool
}{
	{"cmpl-abc:1:2", "cmpl-abc:1", 2, true},
	{"req-1:2", "req-1", 2, true},
	{":1", "", 1, true},
	{"a:b:c:16", "a:b:c", 16, true},
	{"id:01", "id", 1, true},                    // leading zeros
	{"id:+2", "id", 2, true},                    // a sign
	{"id: 2 ", "id", 2, true},                   // surrounding whitespace
	{"id:\t\v\f\r\n8\n", "id", 8, true},         // any C-locale space
	{"id:1_0", "id", 10, true},                  // '_' between digits
	{"id:\u00a04\u3000", "id", 4, true},         // non-ASCII whitespace
	{"id:\u0663", "id", 3, true},                // ARABIC-INDIC DIGIT THREE
	{"id:\U0001D7D0\U0001D7D9", "id", 21, true}, // mathematical digits, two runs
	{"id:\u0085 7", "id", 7, true},              // NEL is whitespace
	{"req-ü:3", "req-ü", 3, true},
	{"id:9223372036854775807", "id", 1<<63 - 1, true},
	{"noratio", "", 0, false},
	{"", "", 0, false},
	{"id:", "", 0, false},
	{"id:0", "", 0, false},
	{"id:-1", "", 0, false},
	{"id:-0", "", 0, false},
	{"id:x", "", 0, false},
	{"id:1x", "", 0, false},
	{"id:0x10", "", 0, false},
	{"id:+", "", 0, false},
	{"id:+ 2", "", 0, false},
	{"id:1__0", "", 0, false},
	{"id:_1", "", 0, false},
	{"id:1_", "", 0, false},
	{"id:2.0", "", 0, false},
	{"id:1\x00", "", 0, false},
	{"id:5\x7f", "", 0, false},
	{"id:\x1c5", "", 0, false},  // a Unicode space Python's int() does not strip: it is ASCII
	{"id:\u00b2", "", 0, false}, // SUPERSCRIPT TWO is a digit but not a decimal
	{"id:9223372036854775808", "", 0, false},
	{"id:" + strings.Repeat("1", 4301), "", 0, false},
	{"\xff:1", "", 0, false},
	{"id:\xed\xa0\x80", "", 0, false}, // an encoded surrogate is not UTF-8
}

func TestReadNotif(t *testing.T) {
	if got := ReadNotif("cmpl-abc:1", 2); got != "cmpl-abc:1:2" {
		t.Fatalf("format %q", got)
	}
	for _, c := range notifCases {
		id, n, err := ParseReadNotif([]byte(c.in))
		if c.ok != (err == nil) || id != c.id || n != c.ratio {
			t.Errorf("ParseReadNotif(%q) = %q, %d, %v; want %q, %d, ok %v", c.in, id, n, err, c.id, c.ratio, c.ok)
		}
		if err != nil && !errors.Is(err, ErrMalformed) {
			t.Errorf("%q: %v does not wrap ErrMalformed", c.in, err)
		}
	}
	for _, ratio := range []int{1, 2, 8} {
		id := "chatcmpl-" + strconv.Itoa(ratio) + ":xyz"
		if gid, gn, err := ParseReadNotif([]byte(ReadNotif(id, ratio))); err != nil || gid != id || gn != ratio {
			t.Errorf("round trip %q %d: %q %d %v", id, ratio, gid, gn, err)
		}
	}
}

// Every decimal digit of Go's tables has the value Unicode gives it: the
// runs of unicode.Nd are whole 0..9 runs, so decimalValue's rule holds.
func TestDecimalValueRuns(t *testing.T) {
	check := func(lo, hi, stride uint32) {
		if stride != 1 || (hi-lo+1)%10 != 0 {
			t.Errorf("Nd range %#x-%#x stride %d is not whole runs of ten", lo, hi, stride)
		}
		for r := lo; r <= hi; r++ {
			if d, ok := decimalValue(rune(r)); !ok || d != int(r-lo)%10 {
				t.Errorf("decimalValue(%#x) = %d, %v", r, d, ok)
			}
		}
	}
	for _, r := range unicode.Nd.R16 {
		check(uint32(r.Lo), uint32(r.Hi), uint32(r.Stride))
	}
	for _, r := range unicode.Nd.R32 {
		check(r.Lo, r.Hi, r.Stride)
	}
}

// vLLM's kv_connector/v1/nixl_connector.py's own parsing (Python's rsplit and int()) agrees with
// ParseReadNotif on every case: same request id and count where Python
// gives a positive int that fits, an error everywhere else.
func TestReadNotifMatchesPython(t *testing.T) {
	zmqtest.RequirePython(t, "zmq", "msgpack")
	inputs := make([]string, 0, len(notifCases)+16)
	for _, c := range notifCases {
		inputs = append(inputs, c.in)
	}
	// A digit of every Nd run Python 3.11 (Unicode 14) also knows, and
	// every non-ASCII space.
	for _, r := range []rune{0x0966, 0x0BE7, 0x0E52, 0x0F23, 0x1049, 0xFF15, 0x104A4, 0x11066, 0x1E959} {
		inputs = append(inputs, "id:1"+string(r))
	}
	for _, r := range []rune{0x1680, 0x2000, 0x200A, 0x2028, 0x2029, 0x202F, 0x205F, 0x180E, 0x200B, 0xFEFF} {
		inputs = append(inputs, "id:"+string(r)+"3")
	}
	spec := make([]string, len(inputs))
	for i, in := range inputs {
		spec[i] = hex.EncodeToString([]byte(in))
	}
	path := filepath.Join(t.TempDir(), "notifs.json")
	b, _ := json.Marshal(spec)
	if err := os.WriteFile(path, b, 0o644); err != nil {
		t.Fatal(err)
	}
	peer := zmqtest.Start(t, peerScript, "notif", path)
	var py []*[2]string
	if err := json.Unmarshal([]byte(peer.Line(30*time.Second)), &py); err != nil {
		t.Fatal(err)
	}
	peer.Wait(10 * time.Second)
	if len(py) != len(inputs) {
		t.Fatalf("python answered %d of %d", len(py), len(inputs))
	}
	for i, in := range inputs {
		id, n, err := ParseReadNotif([]byte(in))
		want := py[i]
		if want == nil {
			if err == nil {
				t.Errorf("%q: python refuses it, go parsed %q, %d", in, id, n)
			}
			continue
		}
		pn, perr := strconv.ParseInt(want[1], 10, 0)
		if perr != nil || pn <= 0 { // beyond int, or not positive: refused on purpose
			if err == nil {
				t.Errorf("%q: python count %s, go accepted %d", in, want[1], n)
			}
			continue
		}
		if err != nil || id != want[0] || int64(n) != pn {
			t.Errorf("%q: python %q, %s; go %q, %d, %v", in, want[0], want[1], id, n, err)
		}
	}
}

func FuzzParseReadNotif(f *testing.F) {
	for _, c := range notifCases {
		f.Add([]byte(c.in))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		id, n, err := ParseReadNotif(b)
		if err != nil {
			if !errors.Is(err, ErrMalformed) {
				t.Fatalf("%q: %v does not wrap ErrMalformed", b, err)
			}
			return
		}
		// What is accepted has a positive count and parses back the same
		// way once formatted canonically.
		if n <= 0 || !strings.HasPrefix(string(b), id+":") {
			t.Fatalf("%q parsed to %q, %d", b, id, n)
		}
		if gid, gn, err := ParseReadNotif([]byte(ReadNotif(id, n))); err != nil || gid != id || gn != n {
			t.Fatalf("%q: canonical form does not round-trip: %q %d %v", b, gid, gn, err)
		}
		// ASCII-only counts agree with strconv once the Python extras
		// (spaces, '+', '_') are gone.
		tail := string(b[len(id)+1:])
		if plain := strings.TrimSpace(strings.ReplaceAll(strings.TrimLeft(strings.TrimSpace(tail), "+"), "_", "")); isASCIIDigits(plain) {
			if v, err := strconv.Atoi(plain); err != nil || v != n {
				t.Fatalf("%q: count %d, strconv says %d (%v)", b, n, v, err)
			}
		}
	})
}

func isASCIIDigits(s string) bool {
	if s == "" {
		return false
	}
	for i := 0; i < len(s); i++ {
		if s[i] < '0' || s[i] > '9' {
			return false
		}
	}
	return true
}
