package sglang

import (
	"bytes"
	"encoding/hex"
	"errors"
	"reflect"
	"strings"
	"testing"
)

func roundTrip(t *testing.T, m Message) Message {
	t.Helper()
	frames, err := m.Frames()
	if err != nil {
		t.Fatalf("%s: Frames: %v", kindOf(m), err)
	}
	got, err := parseAs(m, frames)
	if err != nil {
		t.Fatalf("%s: parse: %v", kindOf(m), err)
	}
	return got
}

func TestRoundTripFixtures(t *testing.T) {
	for i, m := range fixtures() {
		got := roundTrip(t, m)
		if !reflect.DeepEqual(toSpec(got), toSpec(m)) {
			t.Errorf("fixture %d (%s):\n got %v\nwant %v", i, kindOf(m), toSpec(got), toSpec(m))
		}
	}
}

// Golden bytes computed with SGLang's disaggregation/{nixl,mori}/conn.py's struct/numpy calls.
func TestGoldenLayouts(t *testing.T) {
	// pack_int_lists([[1, -2], [], [3]], "i")
	if got := hex.EncodeToString(PackInt32Lists([][]int32{{1, -2}, {}, {3}})); got != "03000000"+"08000000"+"00000000"+"04000000"+"01000000feffffff"+"03000000" {
		t.Errorf("pack_int_lists i: %s", got)
	}
	// pack_int_lists([[2**40]], "Q"), pack_int_lists([[7]], "I"), pack_int_lists([], ...)
	if got := hex.EncodeToString(PackUint64Lists([][]uint64{{1 << 40}})); got != "01000000"+"08000000"+"0000000000010000" {
		t.Errorf("pack_int_lists Q: %s", got)
	}
	if got := hex.EncodeToString(PackUint32Lists([][]uint32{{7}})); got != "010000000400000007000000" {
		t.Errorf("pack_int_lists I: %s", got)
	}
	if PackUint32Lists(nil) != nil {
		t.Error("empty lists must pack to no bytes")
	}
	// struct.pack(">I", 5) for AUX_DATA, np.int32 .tobytes() for indices.
	f, _ := (&AuxData{Room: 1, Data: []byte("hello")}).Frames()
	if hex.EncodeToString(f[4]) != "00000005" {
		t.Errorf("aux length frame %x", f[4])
	}
	f, _ = (&NIXLTransferInfo{Room: 1, DstKVIndices: []int32{1, -1}, RequiredDstInfoNum: 1}).Frames()
	if hex.EncodeToString(f[5]) != "01000000ffffffff" || string(f[9]) != "0" || string(f[6]) != "0" {
		t.Errorf("transfer info frames %q", f)
	}
	f, _ = (&NIXLRegistration{KVPtrs: []uint64{0x0102030405060708}, KVItemLen: 9}).Frames()
	if len(f) != 20 || string(f[1]) != "None" || hex.EncodeToString(f[6]) != "0807060504030201" {
		t.Errorf("registration frames %q", f)
	}
}

func TestUnpackIntListsRejects(t *testing.T) {
	good := PackInt32Lists([][]int32{{1, 2}, {3}})
	cases := map[string][]byte{
		"short header":     {1, 0},
		"count too big":    {0xff, 0xff, 0xff, 0xff, 0, 0, 0, 0},
		"lengths overflow": append(append([]byte{}, good[:8]...), 0xff, 0xff, 0xff, 0x0f),
		"trailing bytes":   append(append([]byte{}, good...), 9),
		"missing bytes":    good[:len(good)-1],
		"partial element":  {1, 0, 0, 0, 3, 0, 0, 0, 1, 2, 3},
	}
	for name, b := range cases {
		if _, err := UnpackInt32Lists(b); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
	if v, err := UnpackInt32Lists(good); err != nil || !reflect.DeepEqual(v, [][]int32{{1, 2}, {3}}) {
		t.Fatalf("good: %v %v", v, err)
	}
}

func mustFrames(t *testing.T, m Message) [][]byte {
	t.Helper()
	f, err := m.Frames()
	if err != nil {
		t.Fatal(err)
	}
	return f
}

func with(frames [][]byte, i int, v string) [][]byte {
	out := append([][]byte{}, frames...)
	out[i] = []byte(v)
	return out
}

// Every kind of bad input is rejected with ErrMalformed and a message that
// says where.
func TestParseRejects(t *testing.T) {
	fx := fixtures()
	nreg, nxfer := mustFrames(t, fx[0]), mustFrames(t, fx[2])
	mreg, mxfer := mustFrames(t, fx[4]), mustFrames(t, fx[6])
	status, aux := mustFrames(t, fx[9]), mustFrames(t, fx[11])
	abort := mustFrames(t, fx[8])
	type tc struct {
		parse  func([][]byte) (Message, error)
		frames [][]byte
		want   string
	}
	cases := map[string]tc{
		"empty":                 {ParseNIXLToPrefill, nil, "empty message"},
		"wrong guard":           {ParseNIXLToPrefill, with(nxfer, 0, "MoriMsgGuard"), "foreign traffic"},
		"guard only":            {ParseNIXLToPrefill, nxfer[:1], "guard without payload"},
		"nixl reg too short":    {ParseNIXLToPrefill, nreg[:12], "needs at least 12"},
		"nixl reg bad port":     {ParseNIXLToPrefill, with(nreg, 3, "70000"), "out of range"},
		"nixl reg text port":    {ParseNIXLToPrefill, with(nreg, 3, "http"), "frame 3 (port)"},
		"nixl reg ptr bytes":    {ParseNIXLToPrefill, with(nreg, 6, "1234567"), "whole number"},
		"nixl reg kinds count":  {ParseNIXLToPrefill, with(nreg, 18, "VRAM"), "1 kinds for 4"},
		"nixl reg kind unknown": {ParseNIXLToPrefill, with(nreg, 18, "VRAM,HBM,DRAM,DRAM"), "HBM"},
		"nixl reg item lens":    {ParseNIXLToPrefill, with(nreg, 19, "12345678"), "1 item lens for 4"},
		"nixl reg state lists":  {ParseNIXLToPrefill, with(nreg, 8, "\x09\x00\x00\x00"), "declare 9 lists"},
		"nixl reg staging ptr":  {ParseNIXLToPrefill, with(nreg, 15, "123"), "want 8"},
		"nixl reg non-ascii":    {ParseNIXLToPrefill, with(nreg, 4, "agent\xff"), "not ASCII"},
		"nixl xfer too short":   {ParseNIXLToPrefill, nxfer[:7], "needs at least 7"},
		"nixl xfer room":        {ParseNIXLToPrefill, with(nxfer, 1, "12a"), "frame 1 (room)"},
		"nixl xfer neg room":    {ParseNIXLToPrefill, with(nxfer, 1, "-5"), "non-negative"},
		"nixl xfer aux None":    {ParseNIXLToPrefill, with(nxfer, 6, "None"), "dst aux index"},
		"nixl xfer indices":     {ParseNIXLToPrefill, with(nxfer, 5, "abc"), "whole number"},
		"nixl xfer huge number": {ParseNIXLToPrefill, with(nxfer, 7, "99999999999999999999"), "out of range"},
		"nixl xfer prefix":      {ParseNIXLToPrefill, with(nxfer, 9, "1.5"), "decode_prefix_len"},
		"nixl xfer neg prefix":  {ParseNIXLToPrefill, with(nxfer, 9, "-5"), "(decode_prefix_len): negative"},
		"mori xfer neg prefix":  {ParseMORIToPrefill, with(mxfer, 9, "-5"), "(decode_prefix_len): negative"},
		"mori reg too short":    {ParseMORIToPrefill, mreg[:11], "needs at least 11"},
		"mori reg engine desc":  {ParseMORIToPrefill, with(mreg, 4, "\x91\x01"), "want str"},
		"mori reg desc list":    {ParseMORIToPrefill, with(mreg, 5, "\x91\xa1x"), "want bin"},
		"mori reg desc garbage": {ParseMORIToPrefill, with(mreg, 6, "\xc1"), "frame 6 (aux mem descs)"},
		"mori reg nested":       {ParseMORIToPrefill, with(mreg, 7, "\x91\xc4\x00"), "component 0"},
		"mori xfer too short":   {ParseMORIToPrefill, mxfer[:6], "needs at least 6"},
		"mori xfer empty req":   {ParseMORIToPrefill, with(mxfer, 8, ""), "required_dst_info_num"},
		"mori xfer engine key":  {ParseMORIToPrefill, with(mxfer, 4, "k\x80"), "not ASCII"},
		"staging message":       {ParseNIXLToPrefill, [][]byte{[]byte("WATERMARK"), {}}, "staging"},
		"abort too short":       {ParseMORIToPrefill, abort[:3], "needs at least 4"},
		"abort bad port":        {ParseMORIToPrefill, with(abort, 3, ""), "empty number"},
		"status too short":      {ParseMORIToDecode, status[:3], "needs at least 3"},
		"status bad code":       {ParseMORIToDecode, with(status, 2, "x"), "frame 2 (status)"},
		"status bad utf8":       {ParseMORIToDecode, append(append([][]byte{}, status...)[:4], []byte("\xff\xfe")), "not UTF-8"},
		"aux too short":         {ParseMORIToDecode, aux[:5], "needs at least 6"},
		"aux length mismatch":   {ParseMORIToDecode, with(aux, 4, "\x00\x00\x00\x01"), "length frame says 1"},
		"aux length width":      {ParseMORIToDecode, with(aux, 4, "\x01"), "4-byte"},
		"decode foreign":        {ParseMORIToDecode, with(status, 0, "NixlMsgGuard"), "neither"},
	}
	for name, c := range cases {
		_, err := c.parse(c.frames)
		if err == nil {
			t.Errorf("%s: accepted", name)
			continue
		}
		if !errors.Is(err, ErrMalformed) && !errors.Is(err, ErrUnsupported) {
			t.Errorf("%s: %v does not wrap ErrMalformed", name, err)
		}
		if !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: %q does not mention %q", name, err, c.want)
		}
	}
}

// Fields SGLang's disaggregation/{nixl,mori}/conn.py treats as optional may be missing entirely.
func TestParseOptionalFramesMissing(t *testing.T) {
	fx := fixtures()
	reg := mustFrames(t, fx[0])[:13] // through the KV item len
	m, err := ParseNIXLToPrefill(reg)
	if err != nil {
		t.Fatal(err)
	}
	r := m.(*NIXLRegistration)
	if r.NumSlots != 0 || r.Staging != nil || len(r.KVMemKinds) != 4 || r.KVMemKinds[2] != VRAM || r.KVItemLens[3] != 65536 {
		t.Fatalf("defaults: %+v", r)
	}
	xfer := mustFrames(t, fx[2])[:8]
	m, err = ParseNIXLToPrefill(xfer)
	if err != nil {
		t.Fatal(err)
	}
	if x := m.(*NIXLTransferInfo); x.DecodePrefixLenSet || x.DstStateIndices != nil {
		t.Fatalf("defaults: %+v", x)
	}
	mx := mustFrames(t, fx[6])[:7]
	m, err = ParseMORIToPrefill(mx)
	if err != nil {
		t.Fatal(err)
	}
	if x := m.(*MORITransferInfo); x.RequiredDstInfoNum != 1 || x.DecodePrefixLenSet {
		t.Fatalf("defaults: %+v", x)
	}
}

func TestBuildRejects(t *testing.T) {
	bad := []Message{
		&NIXLRegistration{Endpoint: "hôst"},
		&NIXLRegistration{KVPtrs: []uint64{1}, KVMemKinds: []MemKind{"HBM"}},
		&NIXLRegistration{KVPtrs: []uint64{1}, KVItemLens: []uint64{1, 2}},
		&NIXLTransferInfo{AgentName: "ä"},
		&MORITransferInfo{EngineKey: "ä"},
		&Abort{Endpoint: "ä"},
	}
	for i, m := range bad {
		if _, err := m.Frames(); err == nil {
			t.Errorf("%d (%T): built", i, m)
		}
	}
}

func TestMORIIsDummy(t *testing.T) {
	for _, c := range []struct {
		m    MORITransferInfo
		want bool
	}{
		{MORITransferInfo{DstAuxIndex: -1}, true},
		{MORITransferInfo{DstAuxIndex: 0}, false},
		{MORITransferInfo{DstAuxIndex: -1, DecodePrefixLen: 16}, false},
		{MORITransferInfo{DstAuxIndex: -1, DstKVIndices: []int32{1}}, false},
	} {
		if c.m.IsDummy() != c.want {
			t.Errorf("%+v: IsDummy = %v", c.m, !c.want)
		}
	}
	if !(&NIXLTransferInfo{}).IsDummy() || (&NIXLTransferInfo{DecodePrefixLen: 3}).IsDummy() {
		t.Error("NIXL IsDummy")
	}
}

func TestNotifTags(t *testing.T) {
	cases := []struct {
		tag  string
		want Notif
	}{
		{KVNotif(5, 2, true, 1), Notif{Room: 5, Kind: NotifKV, Chunk: 2, Last: true, PPRank: 1, Component: -1}},
		{"5_kv_0_0", Notif{Room: 5, Kind: NotifKV, Component: -1}},
		{KVPartNotif(5, 3, false, 0, 1, 2), Notif{Room: 5, Kind: NotifKV, Chunk: 3, Part: 1, NumParts: 2, Component: -1}},
		{AuxNotif(9), Notif{Room: 9, Kind: NotifAux, Component: -1}},
		{AuxNoKVNotif(9, 3), Notif{Room: 9, Kind: NotifAux, NoKV: true, PPRank: 3, Component: -1}},
		{StateNotif(9, 1, 2), Notif{Room: 9, Kind: NotifState, PPRank: 1, Component: 2}},
		{"9_state_1", Notif{Room: 9, Kind: NotifState, PPRank: 1, Component: -1}},
		{"9_stg_1_1_0_4_128_16_agent_with_underscores", Notif{Room: 9, Kind: NotifStaging, Chunk: 1, Last: true,
			StagingChunkIdx: 4, PageStart: 128, NumPages: 16, AgentName: "agent_with_underscores", Component: -1}},
	}
	for _, c := range cases {
		got, err := ParseNotif([]byte(c.tag))
		if err != nil {
			t.Errorf("%s: %v", c.tag, err)
			continue
		}
		if got != c.want {
			t.Errorf("%s:\n got %+v\nwant %+v", c.tag, got, c.want)
		}
	}
	golden := map[string]string{
		KVNotif(1, 0, false, 0):          "1_kv_0_0_0",
		KVPartNotif(1, 2, true, 3, 0, 2): "1_kv_2_1_3_part_0_2",
		AuxNotif(1):                      "1_aux",
		AuxNoKVNotif(1, 2):               "1_aux_nokv_2",
		StateNotif(1, 0, 3):              "1_state_0_3",
	}
	for got, want := range golden {
		if got != want {
			t.Errorf("format %q, want %q", got, want)
		}
	}
	for _, bad := range []string{"", "5", "x_kv_0_0_0", "5_kv_0", "5_kv_0_0_0_x", "5_kv_0_0_0_part_2_2",
		"5_kv_0_0_0_part_0_0", "5_aux_x", "5_aux_nokv", "5_aux_nokv_-1", "5_state", "5_state_1_2_3",
		"5_stg_1_1_0_4_128_16", "5_what_1", "-5_aux", "5_kv_a_0_0", "5_kv_0_0_99999999999"} {
		if _, err := ParseNotif([]byte(bad)); !errors.Is(err, ErrBadNotif) {
			t.Errorf("%q: %v, want ErrBadNotif", bad, err)
		}
	}
}

// splitFrames turns fuzz bytes into frames: each frame is a 2-byte
// big-endian length and that many bytes (the last one takes what is left).
func splitFrames(b []byte) [][]byte {
	var out [][]byte
	for len(b) >= 2 && len(out) < 64 {
		n := int(b[0])<<8 | int(b[1])
		b = b[2:]
		n = min(n, len(b))
		out = append(out, b[:n])
		b = b[n:]
	}
	return out
}

func joinFrames(fs [][]byte) []byte {
	var b bytes.Buffer
	for _, f := range fs {
		f = f[:min(len(f), 0xffff)]
		b.WriteByte(byte(len(f) >> 8))
		b.WriteByte(byte(len(f)))
		b.Write(f)
	}
	return b.Bytes()
}

func fuzzParser(f *testing.F, parse func([][]byte) (Message, error)) {
	for _, m := range fixtures() {
		fr, _ := m.Frames()
		f.Add(joinFrames(fr))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		m, err := parse(splitFrames(b))
		if err != nil {
			if !errors.Is(err, ErrMalformed) && !errors.Is(err, ErrUnsupported) {
				t.Fatalf("error %v wraps neither ErrMalformed nor ErrUnsupported", err)
			}
			return
		}
		// Whatever parses must rebuild and parse to the same thing.
		fr, err := m.Frames()
		if err != nil {
			t.Fatalf("parsed %T does not rebuild: %v", m, err)
		}
		m2, err := parse(fr)
		if err != nil {
			t.Fatalf("rebuilt %T does not parse: %v", m, err)
		}
		// The NIXL sender writes str(decode_prefix_len or 0), so a missing
		// prefix length (an older sender) comes back as 0.
		if ti, ok := m.(*NIXLTransferInfo); ok && !ti.DecodePrefixLenSet {
			norm := *ti
			norm.DecodePrefixLenSet = true
			m = &norm
		}
		// The MORI sender, like SGLang's disaggregation/{nixl,mori}/conn.py's, writes only a positive
		// decode_prefix_len and an empty frame otherwise, so a "0" frame
		// comes back as None (both mean no prefix hit).
		if ti, ok := m.(*MORITransferInfo); ok && ti.DecodePrefixLen == 0 && ti.DecodePrefixLenSet {
			norm := *ti
			norm.DecodePrefixLenSet = false
			m = &norm
		}
		if !reflect.DeepEqual(toSpec(m), toSpec(m2)) {
			t.Fatalf("round trip changed %T:\n%v\n%v", m, toSpec(m), toSpec(m2))
		}
	})
}

func FuzzParseNIXLToPrefill(f *testing.F) { fuzzParser(f, ParseNIXLToPrefill) }
func FuzzParseMORIToPrefill(f *testing.F) { fuzzParser(f, ParseMORIToPrefill) }
func FuzzParseMORIToDecode(f *testing.F)  { fuzzParser(f, ParseMORIToDecode) }

func FuzzUnpackIntLists(f *testing.F) {
	f.Add(PackInt32Lists([][]int32{{1, 2}, {}, {3}}))
	f.Add(PackUint64Lists([][]uint64{{1 << 40}}))
	f.Fuzz(func(t *testing.T, b []byte) {
		if v, err := UnpackInt32Lists(b); err == nil && len(b) > 0 && !bytes.Equal(PackInt32Lists(v), b) && len(v) > 0 {
			t.Fatalf("int32 lists do not round-trip: %x", b)
		}
		if v, err := UnpackUint64Lists(b); err == nil && len(v) > 0 && !bytes.Equal(PackUint64Lists(v), b) {
			t.Fatalf("uint64 lists do not round-trip: %x", b)
		}
		UnpackUint32Lists(b)
	})
}

func FuzzParseNotif(f *testing.F) {
	for _, s := range []string{"5_kv_2_1_1", "5_kv_3_0_0_part_1_2", "9_aux", "9_aux_nokv_3", "9_state_1_2", "9_stg_1_1_0_4_128_16_a_b"} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		n, err := ParseNotif(b)
		if err != nil {
			return
		}
		var again string
		switch {
		case n.Kind == NotifKV && n.NumParts > 0:
			again = KVPartNotif(n.Room, n.Chunk, n.Last, n.PPRank, n.Part, n.NumParts)
		case n.Kind == NotifKV:
			again = KVNotif(n.Room, n.Chunk, n.Last, n.PPRank)
		case n.Kind == NotifAux && n.NoKV:
			again = AuxNoKVNotif(n.Room, n.PPRank)
		case n.Kind == NotifAux:
			again = AuxNotif(n.Room)
		case n.Kind == NotifState && n.Component >= 0:
			again = StateNotif(n.Room, n.PPRank, n.Component)
		default:
			return
		}
		n2, err := ParseNotif([]byte(again))
		if err != nil || n2 != n {
			t.Fatalf("%q -> %+v -> %q -> %+v %v", b, n, again, n2, err)
		}
	})
}
