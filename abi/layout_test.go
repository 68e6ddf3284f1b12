package abi

import (
	"bufio"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"strconv"
	"strings"
	"testing"
)

// mirrored lists every Go mirror type with its C name.
var mirrored = []struct {
	cName string
	goVal any
}{
	{"kvp_error_destroy_args", ErrorDestroyArgs{}},
	{"kvp_error_message_args", ErrorMessageArgs{}},
	{"kvp_error_code_args", ErrorCodeArgs{}},
	{"kvp_plugin_info_args", PluginInfoArgs{}},
	{"kvp_param", Param{}},
	{"kvp_agent_create_args", AgentCreateArgs{}},
	{"kvp_agent_destroy_args", AgentDestroyArgs{}},
	{"kvp_mem_desc", MemDesc{}},
	{"kvp_register_mem_args", RegisterMemArgs{}},
	{"kvp_deregister_mem_args", DeregisterMemArgs{}},
	{"kvp_region_export_args", RegionExportArgs{}},
	{"kvp_local_metadata_args", LocalMetadataArgs{}},
	{"kvp_load_remote_args", LoadRemoteArgs{}},
	{"kvp_remove_remote_args", RemoveRemoteArgs{}},
	{"kvp_remote_region_import_args", RemoteRegionImportArgs{}},
	{"kvp_remote_region_release_args", RemoteRegionReleaseArgs{}},
	{"kvp_xfer_desc", XferDesc{}},
	{"kvp_prep_dlist_args", PrepDListArgs{}},
	{"kvp_release_dlist_args", ReleaseDListArgs{}},
	{"kvp_notif", Notif{}},
	{"kvp_make_prepped_xfer_args", MakePreppedXferArgs{}},
	{"kvp_region_pair", RegionPair{}},
	{"kvp_batch_entry", BatchEntry{}},
	{"kvp_make_batch_xfer_args", MakeBatchXferArgs{}},
	{"kvp_post_xfer_args", PostXferArgs{}},
	{"kvp_poll_xfer_args", PollXferArgs{}},
	{"kvp_submit_xfer_args", SubmitXferArgs{}},
	{"kvp_get_event_fd_args", GetEventFDArgs{}},
	{"kvp_release_xfer_args", ReleaseXferArgs{}},
	{"kvp_xfer_telemetry_args", XferTelemetryArgs{}},
	{"kvp_get_notifs_args", GetNotifsArgs{}},
	{"kvp_send_notif_args", SendNotifArgs{}},
	{"kvp_api", API{}},
	{"kvp_get_api_args", GetAPIArgs{}},
}

// structSizes pairs the C STRUCT_SIZE macros with the Go values.
var structSizes = map[string]uintptr{
	"KVP_ERROR_DESTROY_ARGS_STRUCT_SIZE":         ErrorDestroyArgsSize,
	"KVP_ERROR_MESSAGE_ARGS_STRUCT_SIZE":         ErrorMessageArgsSize,
	"KVP_ERROR_CODE_ARGS_STRUCT_SIZE":            ErrorCodeArgsSize,
	"KVP_PLUGIN_INFO_ARGS_STRUCT_SIZE":           PluginInfoArgsSize,
	"KVP_AGENT_CREATE_ARGS_STRUCT_SIZE":          AgentCreateArgsSize,
	"KVP_AGENT_DESTROY_ARGS_STRUCT_SIZE":         AgentDestroyArgsSize,
	"KVP_REGISTER_MEM_ARGS_STRUCT_SIZE":          RegisterMemArgsSize,
	"KVP_DEREGISTER_MEM_ARGS_STRUCT_SIZE":        DeregisterMemArgsSize,
	"KVP_REGION_EXPORT_ARGS_STRUCT_SIZE":         RegionExportArgsSize,
	"KVP_LOCAL_METADATA_ARGS_STRUCT_SIZE":        LocalMetadataArgsSize,
	"KVP_LOAD_REMOTE_ARGS_STRUCT_SIZE":           LoadRemoteArgsSize,
	"KVP_REMOVE_REMOTE_ARGS_STRUCT_SIZE":         RemoveRemoteArgsSize,
	"KVP_REMOTE_REGION_IMPORT_ARGS_STRUCT_SIZE":  RemoteRegionImportArgsSize,
	"KVP_REMOTE_REGION_RELEASE_ARGS_STRUCT_SIZE": RemoteRegionReleaseArgsSize,
	"KVP_PREP_DLIST_ARGS_STRUCT_SIZE":            PrepDListArgsSize,
	"KVP_RELEASE_DLIST_ARGS_STRUCT_SIZE":         ReleaseDListArgsSize,
	"KVP_MAKE_PREPPED_XFER_ARGS_STRUCT_SIZE":     MakePreppedXferArgsSize,
	"KVP_MAKE_BATCH_XFER_ARGS_STRUCT_SIZE":       MakeBatchXferArgsSize,
	"KVP_POST_XFER_ARGS_STRUCT_SIZE":             PostXferArgsSize,
	"KVP_POLL_XFER_ARGS_STRUCT_SIZE":             PollXferArgsSize,
	"KVP_POLL_XFER_ARGS_STRUCT_SIZE_1_0":         PollXferArgsSize10,
	"KVP_SUBMIT_XFER_ARGS_STRUCT_SIZE":           SubmitXferArgsSize,
	"KVP_GET_EVENT_FD_ARGS_STRUCT_SIZE":          GetEventFDArgsSize,
	"KVP_RELEASE_XFER_ARGS_STRUCT_SIZE":          ReleaseXferArgsSize,
	"KVP_XFER_TELEMETRY_ARGS_STRUCT_SIZE":        XferTelemetryArgsSize,
	"KVP_GET_NOTIFS_ARGS_STRUCT_SIZE":            GetNotifsArgsSize,
	"KVP_SEND_NOTIF_ARGS_STRUCT_SIZE":            SendNotifArgsSize,
	"KVP_API_STRUCT_SIZE":                        APISize,
	"KVP_API_STRUCT_SIZE_1_0":                    APISize10,
	"KVP_GET_API_ARGS_STRUCT_SIZE":               GetAPIArgsSize,
}

// constants pairs C constants with their Go values.
var constants = map[string]int64{
	"KVP_ABI_MAJOR": Major, "KVP_ABI_MINOR": Minor,
	"KVP_IN_PROG": int64(InProg), "KVP_SUCCESS": int64(Success),
	"KVP_ERR_NOT_POSTED": int64(ErrNotPosted), "KVP_ERR_INVALID_PARAM": int64(ErrInvalidParam),
	"KVP_ERR_BACKEND": int64(ErrBackend), "KVP_ERR_NOT_FOUND": int64(ErrNotFound),
	"KVP_ERR_MISMATCH": int64(ErrMismatch), "KVP_ERR_NOT_ALLOWED": int64(ErrNotAllowed),
	"KVP_ERR_REPOST_ACTIVE": int64(ErrRepostActive), "KVP_ERR_UNKNOWN": int64(ErrUnknown),
	"KVP_ERR_NOT_SUPPORTED": int64(ErrNotSupported), "KVP_ERR_REMOTE_DISCONNECT": int64(ErrRemoteDisconnect),
	"KVP_ERR_CANCELED": int64(ErrCanceled), "KVP_ERR_NO_TELEMETRY": int64(ErrNoTelemetry),
	"KVP_MEM_DRAM": int64(DRAM), "KVP_MEM_VRAM": int64(VRAM),
	"KVP_OP_READ": int64(Read), "KVP_OP_WRITE": int64(Write),
	"KVP_CAP_PREPPED": int64(CapPrepped), "KVP_CAP_BATCH": int64(CapBatch),
	"KVP_CAP_STRIDED": int64(CapStrided), "KVP_CAP_NOTIF": int64(CapNotif),
	"KVP_CAP_TELEMETRY": int64(CapTelemetry), "KVP_CAP_REMOTE_ADDR": int64(CapRemoteAddr),
	"KVP_CAP_REMOTE_BLOB": int64(CapRemoteBlob),
	"KVP_CAP_EVENT_FD":    int64(CapEventFD), "KVP_CAP_SUBMIT": int64(CapSubmit),
	"KVP_POLL_RELEASE": int64(PollRelease), "KVP_POLL_TELEMETRY": int64(PollTelemetry),
	"KVP_MAX_NAME_LEN": MaxNameLen, "KVP_NOTIF_RECORD_HEADER": NotifRecordHeader,
}

// TestLayoutMatchesC compiles a C program against kvplugin.h that prints the
// size, alignment and every field offset of each ABI struct, the STRUCT_SIZE
// macros and the constants, and compares them with the Go mirror.
func TestLayoutMatchesC(t *testing.T) {
	cc, err := exec.LookPath("gcc")
	if err != nil {
		if cc, err = exec.LookPath("cc"); err != nil {
			t.Fatal("no C compiler (gcc or cc) on PATH: the ABI layout cannot be checked")
		}
	}
	want := map[string]int64{}
	var src strings.Builder
	src.WriteString("#include <stdio.h>\n#include <stddef.h>\n#include \"kvplugin.h\"\nint main(void) {\n")
	for _, m := range mirrored {
		rt := reflect.TypeOf(m.goVal)
		key := m.cName + ".sizeof"
		fmt.Fprintf(&src, "  printf(\"%s %%zu\\n\", sizeof(%s));\n", key, m.cName)
		want[key] = int64(rt.Size())
		key = m.cName + ".alignof"
		fmt.Fprintf(&src, "  printf(\"%s %%zu\\n\", _Alignof(%s));\n", key, m.cName)
		want[key] = int64(rt.Align())
		for i := 0; i < rt.NumField(); i++ {
			f := rt.Field(i)
			cf := f.Tag.Get("c")
			if cf == "" {
				t.Fatalf("%s.%s has no c tag", rt.Name(), f.Name)
			}
			key = m.cName + "." + cf
			fmt.Fprintf(&src, "  printf(\"%s %%zu %%zu\\n\", offsetof(%s, %s), sizeof(((%s*)0)->%s));\n",
				key, m.cName, cf, m.cName, cf)
			want[key+".offset"] = int64(f.Offset)
			want[key+".size"] = int64(f.Type.Size())
		}
	}
	for name, v := range structSizes {
		fmt.Fprintf(&src, "  printf(\"%s %%zu\\n\", (size_t)%s);\n", name, name)
		want[name] = int64(v)
	}
	for name, v := range constants {
		fmt.Fprintf(&src, "  printf(\"%s %%lld\\n\", (long long)%s);\n", name, name)
		want[name] = v
	}
	src.WriteString("  return 0;\n}\n")

	dir := t.TempDir()
	cfile := filepath.Join(dir, "layout.c")
	bin := filepath.Join(dir, "layout")
	if err := os.WriteFile(cfile, []byte(src.String()), 0o644); err != nil {
		t.Fatal(err)
	}
	hdrDir, _ := filepath.Abs(".")
	out, err := exec.Command(cc, "-std=c11", "-Wall", "-Werror", "-I", hdrDir, "-o", bin, cfile).CombinedOutput()
	if err != nil {
		t.Fatalf("compiling the layout probe: %v\n%s", err, out)
	}
	out, err = exec.Command(bin).Output()
	if err != nil {
		t.Fatalf("running the layout probe: %v", err)
	}

	got := map[string]int64{}
	sc := bufio.NewScanner(strings.NewReader(string(out)))
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		parse := func(s string) int64 {
			v, err := strconv.ParseInt(s, 10, 64)
			if err != nil {
				t.Fatalf("bad probe line %q", sc.Text())
			}
			return v
		}
		switch len(fields) {
		case 2:
			got[fields[0]] = parse(fields[1])
		case 3:
			got[fields[0]+".offset"] = parse(fields[1])
			got[fields[0]+".size"] = parse(fields[2])
		default:
			t.Fatalf("bad probe line %q", sc.Text())
		}
	}
	if len(got) != len(want) {
		t.Errorf("probe printed %d values, want %d", len(got), len(want))
	}
	for k, w := range want {
		if g, ok := got[k]; !ok {
			t.Errorf("%s: not printed by the probe", k)
		} else if g != w {
			t.Errorf("%s: C says %d, Go mirror says %d", k, g, w)
		}
	}
}

// TestEveryCStructIsMirrored makes sure no typedef struct in the header is
// left out of the layout check.
func TestEveryCStructIsMirrored(t *testing.T) {
	hdr, err := os.ReadFile("kvplugin.h")
	if err != nil {
		t.Fatal(err)
	}
	have := map[string]bool{}
	for _, m := range mirrored {
		have[m.cName] = true
	}
	for _, line := range strings.Split(string(hdr), "\n") {
		line = strings.TrimSpace(line)
		if !strings.HasPrefix(line, "typedef struct ") || !strings.HasSuffix(line, "{") {
			continue
		}
		name := strings.Fields(line)[2]
		if !have[name] {
			t.Errorf("%s is in kvplugin.h but not mirrored in abi.go", name)
		}
	}
}

func TestCapsNames(t *testing.T) {
	c := CapPrepped | CapNotif | Caps(1)<<40
	got := strings.Join(c.Names(), ",")
	if got != "prepped,notif,bit40" {
		t.Fatalf("Names() = %q", got)
	}
	for _, n := range (CapPrepped | CapBatch | CapStrided | CapNotif | CapTelemetry | CapRemoteAddr | CapRemoteBlob).Names() {
		if _, ok := CapByName(n); !ok {
			t.Errorf("CapByName(%q) not found", n)
		}
	}
	if ErrNotFound.String() != "ERR_NOT_FOUND" || Status(-99).String() != "STATUS(-99)" {
		t.Fatal("Status.String")
	}
}

// TestEveryConstantIsMirrored makes sure every object-like #define of the
// header (a constant or a STRUCT_SIZE macro) is compared by
// TestLayoutMatchesC, and that the entry symbol's name agrees.
func TestEveryConstantIsMirrored(t *testing.T) {
	hdr, err := os.ReadFile("kvplugin.h")
	if err != nil {
		t.Fatal(err)
	}
	// Not values: the include guard, the export attribute, the entry
	// symbol's name (checked below).
	skip := map[string]bool{"KVPLUGIN_H": true, "KVP_EXPORT": true, "KVP_ENTRY_SYMBOL": true}
	for _, line := range strings.Split(string(hdr), "\n") {
		fields := strings.Fields(line)
		if len(fields) < 2 || fields[0] != "#define" || strings.Contains(fields[1], "(") || skip[fields[1]] {
			continue
		}
		name := fields[1]
		if _, ok := constants[name]; ok {
			continue
		}
		if _, ok := structSizes[name]; ok {
			continue
		}
		t.Errorf("%s is defined in kvplugin.h but not compared with the Go mirror", name)
	}
	if want := `#define KVP_ENTRY_SYMBOL "` + EntrySymbol + `"`; !strings.Contains(string(hdr), want) {
		t.Errorf("kvplugin.h does not say %s", want)
	}
}
