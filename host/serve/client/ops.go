package client

import (
	"context"
	"encoding/binary"
	"strings"

	"github.com/kvhost/kvhost/host/internal/msgpack"
)

// Room states (SGLang's KVPoll).
const (
	StateFailed          = 0
	StateBootstrapping   = 1
	StateWaitingForInput = 2
	StateTransferring    = 3
	StateSuccess         = 4
	// StateUnknown is poll's answer for a room the rank does not have.
	StateUnknown = 255
)

// Region is one region of register_memory: host memory by shared-memory
// name (Kind "dram") or GPU memory by CUDA IPC handle (Kind "vram").
// RegisterAs, when set, is the region's register_as: the memory kind the
// sidecar registers it with the plugin as ("vram" for host memory that a
// plugin modelling GPU memory with host memory, the fake one, takes).
type Region struct {
	Kind       string
	Addr       uint64
	Length     uint64
	SHM        string
	Offset     uint64
	CUDAIPC    []byte
	Device     int
	RegisterAs string
}

func (r Region) fields() Fields {
	f := Fields{{"kind", r.Kind}, {"addr", r.Addr}, {"length", r.Length}, {"offset", r.Offset}}
	if r.RegisterAs != "" {
		f = append(f, Field{"register_as", r.RegisterAs})
	}
	if r.Kind == "vram" {
		return append(f, Field{"cuda_ipc", r.CUDAIPC}, Field{"device", r.Device})
	}
	return append(f, Field{"shm", r.SHM})
}

// RegisterMemory registers regions and returns their ids.
func (c *Client) RegisterMemory(ctx context.Context, regions []Region) ([]uint64, error) {
	fs := make([]Fields, len(regions))
	for i, r := range regions {
		fs[i] = r.fields()
	}
	v, err := c.call(ctx, "register_memory", Fields{{"regions", fs}})
	if err != nil {
		return nil, err
	}
	rs, _ := v.Get("regions")
	ids := make([]uint64, len(rs.Items))
	for i, x := range rs.Items {
		ids[i], _ = x.Uint()
	}
	return ids, nil
}

// DeregisterMemory releases regions.
func (c *Client) DeregisterMemory(ctx context.Context, ids []uint64) error {
	_, err := c.call(ctx, "deregister_memory", Fields{{"regions", ids}})
	return err
}

// SGLangRank is open_rank's SGLang fields (SGLang's KVArgs and server
// args).
type SGLangRank struct {
	Role                                  string // prefill or decode
	KVDataPtrs, KVDataLens, KVItemLens    []uint64
	AuxDataPtrs, AuxDataLens, AuxItemLens []uint64
	// State is the hybrid-model state, one entry per SGLang state type
	// (kv_args.state_types order). StateType and the flat State* lists
	// are the older one-component form, used when State is nil.
	State                                      []StateComponent
	StateType                                  string
	StateDataPtrs, StateDataLens               []uint64
	StateItemLens, StateDimPerTensor           []uint64
	PageSize, KVHeadNum, TotalKVHeadNum        int
	PrefillStartLayer, GPUID                   int
	TPSize, TPRank, PPSize, PPRank             int
	DPSize, DPRank                             int
	IsMLA                                      bool
	KVCacheDType, Variant, Host, BootstrapAddr string
	// AgentParams override the sidecar's --agent-param for this rank's
	// agent (e.g. num_threads).
	AgentParams map[string]string
}

// StateComponent is one SGLang state type of a rank and its tensors
// (SGLang's kv_args.state_data_ptrs[i] ...); DimPerTensor may be nil.
type StateComponent struct {
	Type                         string
	DataPtrs, DataLens, ItemLens []uint64
	DimPerTensor                 []uint64
}

// Rank is open_rank's answer.
type Rank struct {
	ID       uint64
	Agent    string
	Endpoint string
	// AgentParams are the parameters the rank's agent was created with,
	// the host's defaults included.
	AgentParams map[string]string
}

// OpenSGLang opens an SGLang rank.
func (c *Client) OpenSGLang(ctx context.Context, r SGLangRank) (Rank, error) {
	f := Fields{
		{"style", "sglang"}, {"role", r.Role},
		{"kv_data_ptrs", r.KVDataPtrs}, {"kv_data_lens", r.KVDataLens}, {"kv_item_lens", r.KVItemLens},
		{"aux_data_ptrs", r.AuxDataPtrs}, {"aux_data_lens", r.AuxDataLens}, {"aux_item_lens", r.AuxItemLens},
		{"page_size", r.PageSize}, {"kv_head_num", r.KVHeadNum}, {"total_kv_head_num", r.TotalKVHeadNum},
		{"prefill_start_layer", r.PrefillStartLayer}, {"gpu_id", r.GPUID},
		{"tp_size", r.TPSize}, {"tp_rank", r.TPRank}, {"pp_size", max(r.PPSize, 1)}, {"pp_rank", r.PPRank},
		{"dp_size", max(r.DPSize, 1)}, {"dp_rank", r.DPRank}, {"is_mla", r.IsMLA},
	}
	if r.State != nil {
		types := make([]string, len(r.State))
		var ptrs, lens, items, dims []any
		for i, c := range r.State {
			types[i] = c.Type
			ptrs, lens, items = append(ptrs, c.DataPtrs), append(lens, c.DataLens), append(items, c.ItemLens)
			dims = append(dims, c.DimPerTensor)
		}
		f = append(f, Field{"state_types", types}, Field{"state_data_ptrs", ptrs}, Field{"state_data_lens", lens},
			Field{"state_item_lens", items}, Field{"state_dim_per_tensor", dims})
	} else if r.StateType != "" && r.StateType != "none" {
		f = append(f, Field{"state_type", r.StateType},
			Field{"state_data_ptrs", r.StateDataPtrs}, Field{"state_data_lens", r.StateDataLens},
			Field{"state_item_lens", r.StateItemLens})
		if r.StateDimPerTensor != nil {
			f = append(f, Field{"state_dim_per_tensor", r.StateDimPerTensor})
		}
	}
	for _, s := range []struct{ k, v string }{{"kv_cache_dtype", r.KVCacheDType}, {"variant", r.Variant}, {"host", r.Host}, {"bootstrap_addr", r.BootstrapAddr}} {
		if s.v != "" {
			f = append(f, Field{s.k, s.v})
		}
	}
	return c.openRank(ctx, withAgentParams(f, r.AgentParams))
}

// OpenRank opens a rank with raw fields (style, role and the style's).
func (c *Client) OpenRank(ctx context.Context, fields map[string]any) (Rank, error) {
	f := make(Fields, 0, len(fields))
	for k, v := range fields {
		f = append(f, Field{k, v})
	}
	return c.openRank(ctx, f)
}

func (c *Client) openRank(ctx context.Context, f Fields) (Rank, error) {
	v, err := c.call(ctx, "open_rank", f)
	if err != nil {
		return Rank{}, err
	}
	id, _ := u64(v, "rank")
	rk := Rank{ID: id, Agent: str(v, "agent"), Endpoint: str(v, "endpoint")}
	if ap, ok := v.Get("agent_params"); ok {
		rk.AgentParams = map[string]string{}
		ap.Each(func(k string, x msgpack.Value) bool {
			rk.AgentParams[strings.Clone(k)], _ = x.Str()
			return true
		})
	}
	return rk, nil
}

// withAgentParams adds open_rank's agent_params field when params is set.
func withAgentParams(f Fields, params map[string]string) Fields {
	if len(params) == 0 {
		return f
	}
	m := make(map[string]any, len(params))
	for k, v := range params {
		m[k] = v
	}
	return append(f, Field{"agent_params", m})
}

// CloseRank closes a rank (its rooms fail with "rank closed").
func (c *Client) CloseRank(ctx context.Context, rank uint64) error {
	_, err := c.call(ctx, "close_rank", Fields{{"rank", rank}})
	return err
}

// StartBootstrap starts the sidecar's bootstrap server (SGLang's
// KVBootstrapServer) and returns its host:port.
func (c *Client) StartBootstrap(ctx context.Context, host string, port int) (string, error) {
	v, err := c.call(ctx, "start_bootstrap", Fields{{"host", host}, {"port", port}})
	if err != nil {
		return "", err
	}
	return str(v, "addr"), nil
}

// Pages packs page indices as the API's pages (little-endian int32).
func Pages(p []int32) []byte {
	b := make([]byte, 4*len(p))
	for i, x := range p {
		binary.LittleEndian.PutUint32(b[4*i:], uint32(x))
	}
	return b
}

// pagesOrNil is Pages, nil for nil.
func pagesOrNil(p []int32) any {
	if p == nil {
		return nil
	}
	return Pages(p)
}

// SenderCreate opens a prefill room (Bootstrapping).
func (c *Client) SenderCreate(ctx context.Context, rank, room uint64) error {
	_, err := c.call(ctx, "sender_create", Fields{{"rank", rank}, {"room", room}})
	if err == nil {
		c.track(rank, room)
	}
	return err
}

// SenderInit declares the pages the room will send and its aux slot.
func (c *Client) SenderInit(ctx context.Context, rank, room uint64, numPages int, auxIndex int64) error {
	_, err := c.call(ctx, "sender_init", Fields{{"rank", rank}, {"room", room}, {"num_pages", numPages}, {"aux_index", auxIndex}})
	return err
}

// SenderSend sends one chunk of pages (state indices with the last one,
// or nil).
func (c *Client) SenderSend(ctx context.Context, rank, room uint64, pages []int32, stateIndices []int32) error {
	_, err := c.StartSenderSend(ctx, rank, room, pages, stateIndices).Wait(ctx)
	return err
}

// StartSenderSend is SenderSend without waiting for the reply (see Start):
// the chunks of a room started in order are sent in order.
func (c *Client) StartSenderSend(ctx context.Context, rank, room uint64, pages []int32, stateIndices []int32) *Pending {
	return c.start(ctx, "sender_send", Fields{{"rank", rank}, {"room", room}, {"pages", Pages(pages)}, {"state_indices", pagesOrNil(stateIndices)}})
}

// SenderPrefixLen returns a WaitingForInput prefill room's
// decode_prefix_len: the tokens its decode side already holds.
func (c *Client) SenderPrefixLen(ctx context.Context, rank, room uint64) (int64, error) {
	v, err := c.call(ctx, "sender_prefix_len", Fields{{"rank", rank}, {"room", room}})
	if err != nil {
		return 0, err
	}
	return i64(v, "prefix_len"), nil
}

// SenderSendStates is SenderSend for a rank with state components:
// stateIndices has one entry per component (nil: none for it), or is nil.
func (c *Client) SenderSendStates(ctx context.Context, rank, room uint64, pages []int32, stateIndices [][]int32) error {
	_, err := c.call(ctx, "sender_send", Fields{{"rank", rank}, {"room", room}, {"pages", Pages(pages)}, {"state_indices", stateLists(stateIndices)}})
	return err
}

// ReceiverInitStates is ReceiverInit with state indices per component.
func (c *Client) ReceiverInitStates(ctx context.Context, rank, room uint64, pages []int32, auxIndex int64, stateIndices [][]int32, prefixLen int) error {
	_, err := c.call(ctx, "receiver_init", Fields{{"rank", rank}, {"room", room}, {"pages", Pages(pages)}, {"aux_index", auxIndex},
		{"state_indices", stateLists(stateIndices)}, {"prefix_len", prefixLen}})
	return err
}

// stateLists is the API's per-component state indices: an array of
// packed lists or nil, nil for nil.
func stateLists(s [][]int32) any {
	if s == nil {
		return nil
	}
	out := make([]any, len(s))
	for i, x := range s {
		out[i] = pagesOrNil(x)
	}
	return out
}

// ReceiverCreate opens a decode room and starts its bootstrap.
// prefillDPRank < 0 means nil (follow the room).
func (c *Client) ReceiverCreate(ctx context.Context, rank, room uint64, bootstrapAddr string, prefillDPRank int) error {
	var dp any
	if prefillDPRank >= 0 {
		dp = prefillDPRank
	}
	_, err := c.call(ctx, "receiver_create", Fields{{"rank", rank}, {"room", room}, {"bootstrap_addr", bootstrapAddr}, {"prefill_dp_rank", dp}})
	if err == nil {
		c.track(rank, room)
	}
	return err
}

// ReceiverInit sends decode's page list, aux slot, state slots (nil: none)
// and prefix length to the prefill ranks.
func (c *Client) ReceiverInit(ctx context.Context, rank, room uint64, pages []int32, auxIndex int64, stateIndices []int32, prefixLen int) error {
	_, err := c.call(ctx, "receiver_init", Fields{{"rank", rank}, {"room", room}, {"pages", Pages(pages)}, {"aux_index", auxIndex},
		{"state_indices", pagesOrNil(stateIndices)}, {"prefix_len", prefixLen}})
	return err
}

// Abort fails a room (prefill or decode) and tells its peers.
func (c *Client) Abort(ctx context.Context, rank, room uint64) error {
	_, err := c.call(ctx, "abort", Fields{{"rank", rank}, {"room", room}})
	return err
}

// CloseRoom forgets a room.
func (c *Client) CloseRoom(ctx context.Context, rank, room uint64) error {
	_, err := c.StartCloseRoom(ctx, rank, room).Wait(ctx)
	return err
}

// StartCloseRoom is CloseRoom without waiting for the reply (see Start).
func (c *Client) StartCloseRoom(ctx context.Context, rank, room uint64) *Pending {
	c.untrack(rank, room)
	return c.start(ctx, "close_room", Fields{{"rank", rank}, {"room", room}})
}

// Poll returns the state of each room (StateUnknown for a room the rank
// does not have) and the reasons of the failed ones.
func (c *Client) Poll(ctx context.Context, rank uint64, rooms []uint64) ([]int, map[uint64]string, error) {
	b := make([]byte, 8*len(rooms))
	for i, r := range rooms {
		binary.LittleEndian.PutUint64(b[8*i:], r)
	}
	v, err := c.call(ctx, "poll", Fields{{"rank", rank}, {"rooms", b}})
	if err != nil {
		return nil, nil, err
	}
	sv, _ := v.Get("states")
	raw, _ := sv.Bin()
	states := make([]int, len(raw))
	for i, x := range raw {
		states[i] = int(x)
	}
	reasons := map[uint64]string{}
	if rv, ok := v.Get("reasons"); ok {
		for _, p := range rv.Pairs {
			k, _ := p[0].Str()
			var id uint64
			for _, ch := range k {
				id = id*10 + uint64(ch-'0')
			}
			reasons[id], _ = p[1].Str()
		}
	}
	return states, reasons, nil
}
