package plugin

import (
	"errors"
	"fmt"
	"strings"
	"sync"
	"unsafe"

	"github.com/ebitengine/purego"
	"github.com/kvhost/kvhost/abi"
)

// Info is what a plugin reports about itself (kvp_plugin_info).
type Info struct {
	Name      string   // e.g. "fake"
	Version   string   // the plugin's own version string
	ABIMajor  uint32   // ABI the plugin was built with
	ABIMinor  uint32   //
	Caps      abi.Caps // plugin-wide capabilities; an agent may offer fewer
	MemKinds  []abi.MemKind
	ParamsDoc []ParamDoc // agent parameters the plugin accepts
}

// ParamDoc documents one agent parameter (a "key=default<TAB>description"
// line of kvp_plugin_info_args.params_doc).
type ParamDoc struct {
	Key         string `json:"key"`
	Default     string `json:"default"`
	Description string `json:"description"`
}

// HasParam reports whether the plugin documents agent parameter key.
func (i Info) HasParam(key string) bool {
	for _, p := range i.ParamsDoc {
		if p.Key == key {
			return true
		}
	}
	return false
}

// Plugin is a loaded plugin library. It is safe for concurrent use.
//
// The library stays mapped for the life of the process even after Close:
// plugins may run threads or register process-wide state that does not
// survive dlclose, and dlopen of the same file again returns the same
// mapping anyway.
type Plugin struct {
	path string
	api  abi.API // a copy of the plugin's table (which is static in the plugin)
	info Info

	mu     sync.Mutex
	agents map[*Agent]struct{}
	closed bool
}

// Open loads the plugin library at path, negotiates ABI version abi.Major
// and validates its function table. Failures are *LoadError.
func Open(path string) (*Plugin, error) {
	lib, err := dlopen(path)
	if err != nil {
		return nil, err
	}
	api, info, err := loadTable(path, lib)
	if err != nil {
		purego.Dlclose(lib)
		return nil, err
	}
	return &Plugin{path: path, api: api, info: info, agents: map[*Agent]struct{}{}}, nil
}

// Load finds the plugin called name in dirs (see Find) and opens it.
func Load(name string, dirs []string) (*Plugin, error) {
	path, err := Find(name, dirs)
	if err != nil {
		return nil, err
	}
	return Open(path)
}

// Probe opens the library at path only to read its Info, then unloads it.
// Failures are *LoadError.
func Probe(path string) (Info, error) {
	lib, err := dlopen(path)
	if err != nil {
		return Info{}, err
	}
	defer purego.Dlclose(lib)
	_, info, err := loadTable(path, lib)
	return info, err
}

// CheckABI asks the plugin at path which ABI majors it serves, offering
// hostMajor. It returns the plugin's range and, when hostMajor is outside it,
// a *LoadError of kind ErrABIMismatch. The conformance suite uses it to check
// that a plugin refuses a major it does not speak.
func CheckABI(path string, hostMajor, hostMinor uint32) (min, max uint32, err error) {
	lib, err := dlopen(path)
	if err != nil {
		return 0, 0, err
	}
	defer purego.Dlclose(lib)
	n, err := negotiate(path, lib, hostMajor, hostMinor)
	return n.PluginABIMajorMin, n.PluginABIMajorMax, err
}

// Path returns the file the plugin was loaded from.
func (p *Plugin) Path() string { return p.path }

// Info returns what the plugin reported about itself.
func (p *Plugin) Info() Info { return p.info }

// Name is the plugin's own name (Info().Name).
func (p *Plugin) Name() string { return p.info.Name }

// Close closes every agent still open on the plugin. Later calls on the
// plugin or its agents return ErrClosed.
func (p *Plugin) Close() error {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return closedError("plugin " + p.info.Name)
	}
	p.closed = true
	agents := make([]*Agent, 0, len(p.agents))
	for a := range p.agents {
		agents = append(agents, a)
	}
	p.mu.Unlock()
	var errs []error
	for _, a := range agents {
		if err := a.Close(); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

func dlopen(path string) (uintptr, error) {
	lib, err := purego.Dlopen(path, purego.RTLD_NOW|purego.RTLD_LOCAL)
	if err != nil {
		return 0, &LoadError{Path: path, Kind: ErrNotPlugin, Detail: "not a loadable library: " + err.Error()}
	}
	return lib, nil
}

// negotiate calls the entry symbol offering hostMajor.
func negotiate(path string, lib uintptr, hostMajor, hostMinor uint32) (abi.GetAPIArgs, error) {
	entry, err := purego.Dlsym(lib, abi.EntrySymbol)
	if err != nil || entry == 0 {
		return abi.GetAPIArgs{}, &LoadError{Path: path, Kind: ErrNoEntry, Detail: "no " + abi.EntrySymbol + " symbol: not a kvhost plugin"}
	}
	args := &abi.GetAPIArgs{StructSize: abi.GetAPIArgsSize, HostABIMajor: hostMajor, HostABIMinor: hostMinor}
	status := abi.Status(int32(callC(entry, unsafe.Pointer(args))))
	served := args.PluginABIMajorMin <= hostMajor && hostMajor <= args.PluginABIMajorMax
	if status != abi.Success || args.API == 0 || !served {
		if served && status == abi.Success {
			return *args, &LoadError{Path: path, Kind: ErrBadTable, Detail: "entry point returned no table for ABI " + itoa(hostMajor)}
		}
		return *args, &LoadError{Path: path, Kind: ErrABIMismatch, Detail: fmt.Sprintf(
			"plugin speaks ABI %d (majors %d..%d), host speaks %d", args.PluginABIMajorMax,
			args.PluginABIMajorMin, args.PluginABIMajorMax, hostMajor)}
	}
	return *args, nil
}

// loadTable negotiates abi.Major, copies and validates the table and reads
// the plugin's info.
func loadTable(path string, lib uintptr) (abi.API, Info, error) {
	n, err := negotiate(path, lib, abi.Major, abi.Minor)
	if err != nil {
		return abi.API{}, Info{}, err
	}
	api, err := copyTable(n.API)
	if err == nil {
		err = checkRequired(&api)
	}
	if err != nil {
		return abi.API{}, Info{}, &LoadError{Path: path, Kind: ErrBadTable, Detail: err.Error()}
	}
	p := &Plugin{path: path, api: api, info: Info{Name: strings.TrimSuffix(strings.TrimPrefix(fileBase(path), filePrefix), fileSuffix)}}
	info, err := p.readInfo()
	if err != nil {
		return abi.API{}, Info{}, &LoadError{Path: path, Kind: ErrBadTable, Detail: "plugin_info: " + err.Error()}
	}
	if info.ABIMajor != abi.Major {
		return abi.API{}, Info{}, &LoadError{Path: path, Kind: ErrABIMismatch, Detail: fmt.Sprintf(
			"plugin_info reports ABI %d.%d but the table was served for ABI %d", info.ABIMajor, info.ABIMinor, abi.Major)}
	}
	if err := checkCapFuncs(&api, info.Caps); err != nil {
		return abi.API{}, Info{}, &LoadError{Path: path, Kind: ErrBadTable, Detail: err.Error()}
	}
	return api, info, nil
}

// minAPISize is the size of the ABI 1.0 table, the smallest a major-1 plugin
// may hand out. A 1.0 table lacks the 1.1 functions (submit_xfer,
// get_event_fd): copyTable leaves them 0, and checkCapFuncs refuses a
// plugin that claims their capabilities without them.
var minAPISize = abi.APISize10

// copyTable copies the plugin's kvp_api (static plugin memory) into Go. A
// table from an older minor is shorter: the fields it lacks stay zero.
func copyTable(addr uintptr) (abi.API, error) {
	var api abi.API
	size := *(*uintptr)(cPointer(addr)) // struct_size is the first field
	if size < minAPISize {
		return api, fmt.Errorf("table struct_size %d is smaller than ABI %d.0's %d bytes", size, abi.Major, minAPISize)
	}
	n := min(size, unsafe.Sizeof(api))
	copy(unsafe.Slice((*byte)(unsafe.Pointer(&api)), n), unsafe.Slice((*byte)(cPointer(addr)), n))
	if api.ABIMajor != abi.Major {
		return api, fmt.Errorf("table is for ABI %d, negotiated %d", api.ABIMajor, abi.Major)
	}
	api.Ext = nil // never followed
	return api, nil
}

// tableFunc names one function slot of the table, for validation messages.
type tableFunc struct {
	name string
	fn   func(*abi.API) uintptr
}

var requiredFuncs = []tableFunc{
	{"error_destroy", func(a *abi.API) uintptr { return a.ErrorDestroy }},
	{"error_message", func(a *abi.API) uintptr { return a.ErrorMessage }},
	{"error_code", func(a *abi.API) uintptr { return a.ErrorCode }},
	{"plugin_info", func(a *abi.API) uintptr { return a.PluginInfo }},
	{"agent_create", func(a *abi.API) uintptr { return a.AgentCreate }},
	{"agent_destroy", func(a *abi.API) uintptr { return a.AgentDestroy }},
	{"register_mem", func(a *abi.API) uintptr { return a.RegisterMem }},
	{"deregister_mem", func(a *abi.API) uintptr { return a.DeregisterMem }},
	{"local_metadata", func(a *abi.API) uintptr { return a.LocalMetadata }},
	{"load_remote", func(a *abi.API) uintptr { return a.LoadRemote }},
	{"remove_remote", func(a *abi.API) uintptr { return a.RemoveRemote }},
	{"post_xfer", func(a *abi.API) uintptr { return a.PostXfer }},
	{"poll_xfer", func(a *abi.API) uintptr { return a.PollXfer }},
	{"release_xfer", func(a *abi.API) uintptr { return a.ReleaseXfer }},
}

// capFuncs lists the functions that capabilities need: a row's functions
// must be present when the plugin reports any bit of the row's caps.
var capFuncs = []struct {
	caps  abi.Caps // the functions are needed if any of these bits is set
	funcs []tableFunc
}{
	{abi.CapPrepped, []tableFunc{
		{"prep_dlist", func(a *abi.API) uintptr { return a.PrepDList }},
		{"release_dlist", func(a *abi.API) uintptr { return a.ReleaseDList }},
		{"make_prepped_xfer", func(a *abi.API) uintptr { return a.MakePreppedXfer }},
	}},
	{abi.CapBatch, []tableFunc{{"make_batch_xfer", func(a *abi.API) uintptr { return a.MakeBatchXfer }}}},
	{abi.CapNotif, []tableFunc{
		{"get_notifs", func(a *abi.API) uintptr { return a.GetNotifs }},
		{"send_notif", func(a *abi.API) uintptr { return a.SendNotif }},
	}},
	{abi.CapTelemetry, []tableFunc{{"xfer_telemetry", func(a *abi.API) uintptr { return a.XferTelemetry }}}},
	{abi.CapRemoteAddr | abi.CapRemoteBlob, []tableFunc{
		{"remote_region_import", func(a *abi.API) uintptr { return a.RemoteRegionImport }},
		{"remote_region_release", func(a *abi.API) uintptr { return a.RemoteRegionRelease }},
	}},
	{abi.CapRemoteBlob, []tableFunc{{"region_export", func(a *abi.API) uintptr { return a.RegionExport }}}},
	{abi.CapSubmit, []tableFunc{{"submit_xfer", func(a *abi.API) uintptr { return a.SubmitXfer }}}},
	{abi.CapEventFD, []tableFunc{{"get_event_fd", func(a *abi.API) uintptr { return a.GetEventFD }}}},
}

// checkRequired checks the functions every plugin must provide.
func checkRequired(api *abi.API) error {
	var missing []string
	for _, f := range requiredFuncs {
		if f.fn(api) == 0 {
			missing = append(missing, f.name)
		}
	}
	if len(missing) > 0 {
		return fmt.Errorf("required functions are NULL: %s", strings.Join(missing, ", "))
	}
	return nil
}

// checkCapFuncs checks that caps is usable and that the table has the
// functions of every capability in caps.
func checkCapFuncs(api *abi.API, caps abi.Caps) error {
	if caps&(abi.CapPrepped|abi.CapBatch) == 0 {
		return fmt.Errorf("capabilities %v have neither prepped nor batch: no transfer is possible", caps.Names())
	}
	if caps.Has(abi.CapBatch) && caps&(abi.CapRemoteAddr|abi.CapRemoteBlob) == 0 {
		return fmt.Errorf("capability batch needs remote_addr or remote_blob to name remote regions")
	}
	var missing []string
	for _, c := range capFuncs {
		if caps&c.caps == 0 {
			continue
		}
		for _, f := range c.funcs {
			if f.fn(api) == 0 {
				missing = append(missing, f.name)
			}
		}
	}
	if len(missing) > 0 {
		return fmt.Errorf("capabilities %v need functions that are NULL: %s", caps.Names(), strings.Join(missing, ", "))
	}
	return nil
}

// readInfo calls plugin_info.
func (p *Plugin) readInfo() (Info, error) {
	args := &abi.PluginInfoArgs{StructSize: abi.PluginInfoArgsSize}
	if err := p.check("plugin_info", callC(p.api.PluginInfo, unsafe.Pointer(args))); err != nil {
		return Info{}, err
	}
	info := Info{
		Name:      cString(args.Name),
		Version:   cString(args.Version),
		ABIMajor:  args.ABIMajor,
		ABIMinor:  args.ABIMinor,
		Caps:      args.Caps,
		ParamsDoc: parseParamsDoc(cString(args.ParamsDoc)),
	}
	for b := 0; b < 64; b++ {
		if args.MemKinds&(1<<b) != 0 {
			info.MemKinds = append(info.MemKinds, abi.MemKind(b))
		}
	}
	if info.Name == "" {
		return Info{}, fmt.Errorf("empty plugin name")
	}
	return info, nil
}

// parseParamsDoc parses "key=default<TAB>description" lines. A line without
// '=' documents a key with no default; blank lines are skipped.
func parseParamsDoc(doc string) []ParamDoc {
	var out []ParamDoc
	for _, line := range strings.Split(doc, "\n") {
		line = strings.TrimRight(line, "\r")
		if strings.TrimSpace(line) == "" {
			continue
		}
		kv, desc, _ := strings.Cut(line, "\t")
		key, def, _ := strings.Cut(kv, "=")
		out = append(out, ParamDoc{Key: strings.TrimSpace(key), Default: def, Description: strings.TrimSpace(desc)})
	}
	return out
}

// check turns the kvp_error* a call returned into an *Error (nil for NULL)
// and frees it.
func (p *Plugin) check(op string, errPtr uintptr) error {
	if errPtr == 0 {
		return nil
	}
	return p.takeError(op, errPtr)
}

// takeError reads and destroys a non-NULL kvp_error.
func (p *Plugin) takeError(op string, errPtr uintptr) *Error {
	code := &abi.ErrorCodeArgs{StructSize: abi.ErrorCodeArgsSize, Error: errPtr}
	callC(p.api.ErrorCode, unsafe.Pointer(code))
	msg := &abi.ErrorMessageArgs{StructSize: abi.ErrorMessageArgsSize, Error: errPtr}
	callC(p.api.ErrorMessage, unsafe.Pointer(msg))
	e := &Error{Plugin: p.info.Name, Op: op, Code: code.Code, Message: string(cBytes(msg.Message, msg.MessageLen))}
	destroy := &abi.ErrorDestroyArgs{StructSize: abi.ErrorDestroyArgsSize, Error: errPtr}
	callC(p.api.ErrorDestroy, unsafe.Pointer(destroy))
	if e.Code >= 0 {
		// A plugin bug; keep the message but never report success as an error code.
		e.Message = fmt.Sprintf("(plugin returned an error object with non-error code %d) %s", int32(e.Code), e.Message)
		e.Code = abi.ErrUnknown
	}
	return e
}

func (p *Plugin) addAgent(a *Agent) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return closedError("plugin " + p.info.Name)
	}
	p.agents[a] = struct{}{}
	return nil
}

func (p *Plugin) removeAgent(a *Agent) {
	p.mu.Lock()
	delete(p.agents, a)
	p.mu.Unlock()
}

func itoa(v uint32) string { return fmt.Sprint(v) }
