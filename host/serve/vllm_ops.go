package serve

import (
	"errors"
	"fmt"
	"math"
	"time"

	"github.com/kvhost/kvhost/host/internal/msgpack"
	"github.com/kvhost/kvhost/host/plugin"
	"github.com/kvhost/kvhost/host/pull"
	"github.com/kvhost/kvhost/host/serve/engmem"
	"github.com/kvhost/kvhost/host/wire/vllm"
)

// The vLLM ops of docs/engine-api.md on the session dispatcher: open_rank
// style "vllm", hold, release, read.

func init() {
	registerStyle("vllm", openVLLMRank)
	registerOp("hold", opVLLMHold)
	registerOp("release", opVLLMRelease)
	registerOp("read", opVLLMRead)
	registerOp("watch", opVLLMWatch)
	registerOp("unwatch", opVLLMUnwatch)
}

// vllmHubOf returns the server's vLLM engine groups.
func vllmHubOf(s *session) *vllmHub {
	return s.srv.state("vllm", func() any {
		abort, err := pull.AbortTimeoutFromEnv()
		if err != nil {
			s.srv.log.Warn("serve: ignoring "+pull.EnvAbortTimeout, "err", err, "abort_timeout", pull.DefaultAbortTimeout)
			abort = pull.DefaultAbortTimeout
		}
		return newVLLMHub(vllmConfig{Logger: s.srv.log, AbortTimeout: abort, Observer: s.srv.cfg.PullObserver,
			HandshakeTimeout: s.srv.cfg.HandshakeTimeout})
	}).(*vllmHub)
}

// vllmEmit sends a vLLM event on the session's connection.
func (s *session) vllmEmit(ev vllmEvent) {
	switch ev.Kind {
	case "released":
		s.event("released", Fields{{"engine_id", ev.EngineID}, {"request_id", ev.RequestID}, {"reason", ev.Reason}})
	case "engine_ready":
		s.event("engine_ready", Fields{{"engine_id", ev.EngineID}, {"endpoint", ev.Endpoint}})
	case "read":
		s.event("read", Fields{{"rank", ev.Rank}, {"request_id", ev.RequestID}, {"ok", ev.OK},
			{"invalid_blocks", vllmPackBlocks(ev.InvalidBlocks)}, {"reason", s.mem.engineTerms(ev.Reason)},
			{"bytes", ev.Bytes}, {"seconds", ev.Seconds}})
	}
}

// vllmWatch arranges, once per session, for its holds to be released and
// its binding dropped when it closes (hub.connClosed).
func vllmWatch(s *session, hub *vllmHub) {
	hub.mu.Lock()
	was := hub.watched[s]
	hub.watched[s] = true
	hub.mu.Unlock()
	if !was {
		s.atClose(func(string) { hub.connClosed(s) })
	}
}

// vllmPrefillImpl and vllmDecodeImpl are the rankImpls of vLLM ranks.
type vllmPrefillImpl struct {
	r     *vllmPrefillRank
	agent *plugin.Agent
}

func (p *vllmPrefillImpl) close(string) {
	p.r.leave()
	p.agent.Close()
}

type vllmDecodeImpl struct {
	d     *vllmDecodeRank
	agent *plugin.Agent
}

func (d *vllmDecodeImpl) close(reason string) {
	d.d.close(reason)
	d.agent.Close()
}

// openVLLMRank is open_rank style "vllm" (docs/engine-api.md, Ranks).
func openVLLMRank(s *session, r *request, rk *rankEntry) (rankImpl, Fields, error) {
	hub := vllmHubOf(s)
	engineID, err := vllmID(r, "engine_id")
	if err != nil {
		return nil, nil, err
	}
	tpSize, err := r.int("tp_size")
	if err != nil {
		return nil, nil, err
	}
	tpRank, err := r.int("tp_rank")
	if err != nil {
		return nil, nil, err
	}
	cache, cerr := vllmCacheOf(s, r, rk)
	if cerr != nil {
		return nil, nil, cerr
	}
	cv, ok := r.get("compat")
	if !ok {
		return nil, nil, missing("compat")
	}
	compat, herr := vllmCompatOf(cv)
	if herr != nil {
		return nil, nil, herr
	}
	lease, lerr := vllmSeconds(r, "kv_lease_duration")
	if lerr != nil {
		return nil, nil, lerr
	}
	params, aperr := rankAgentParams(s, r)
	if aperr != nil {
		return nil, nil, aperr
	}
	side := pull.SenderSide
	if rk.role == "decode" {
		side = pull.ReceiverSide
	}
	vllmWatch(s, hub)
	agent, aerr := s.srv.cfg.Plugin.NewAgent(fmt.Sprintf("kvhost-serve-%s-vllm-%s-%d-%d", s.srv.session, rk.role, tpRank, rk.id),
		s.srv.cfg.Plugin.ForSide(side, params)...)
	if aerr != nil {
		return nil, nil, errorf(CodeBackend, "agent: %v", aerr)
	}
	if rk.role == "prefill" {
		host, err := r.optStr("side_channel_host", s.srv.cfg.Host)
		if err != nil {
			agent.Close()
			return nil, nil, err
		}
		port, err := r.optInt("side_channel_port", 0)
		if err != nil {
			agent.Close()
			return nil, nil, err
		}
		abort, err := vllmSeconds(r, "abort_timeout")
		if err != nil {
			agent.Close()
			return nil, nil, err
		}
		pr, ep, jerr := hub.joinPrefill(s, vllmPrefillSpec{EngineID: engineID, TPSize: tpSize, TPRank: tpRank, CompatHash: compat.Hash,
			Gen: compat.Gen, AttnBackend: compat.AttnBackend, Lease: lease,
			SideHost: host, SidePort: port, AbortTimeout: abort}, agent, cache)
		if jerr != nil {
			agent.Close()
			return nil, nil, vllmAPIError(jerr)
		}
		return &vllmPrefillImpl{r: pr, agent: agent}, Fields{{"agent", agent.Name()}, {"endpoint", ep}, agentParamsField(agent)}, nil
	}
	spec := vllmDecodeSpec{EngineID: engineID, TPSize: tpSize, TPRank: tpRank, CompatHash: compat.Hash, Gen: compat.Gen, Lease: lease}
	var perr error
	if spec.MLA, perr = r.bool("is_mla", false); perr != nil {
		agent.Close()
		return nil, nil, perr
	}
	if spec.BlocksFirst, perr = r.bool("blocks_first", false); perr != nil {
		agent.Close()
		return nil, nil, perr
	}
	if spec.TotalKVHeads, perr = r.optInt("total_kv_heads", 0); perr != nil {
		agent.Close()
		return nil, nil, perr
	}
	if !spec.MLA && spec.TotalKVHeads == 0 {
		agent.Close()
		return nil, nil, missing("total_kv_heads")
	}
	if wins, werr := r.optU64s("block_windows"); werr != nil {
		agent.Close()
		return nil, nil, werr
	} else {
		for i, w := range wins {
			if w > math.MaxInt32 {
				agent.Close()
				return nil, nil, badValue("block_windows", "[%d] = %d is out of range", i, w)
			}
			spec.BlockWindows = append(spec.BlockWindows, int(w))
		}
	}
	d, derr := hub.openDecode(s, rk.id, spec, agent, cache)
	if derr != nil {
		agent.Close()
		return nil, nil, vllmAPIError(derr)
	}
	return &vllmDecodeImpl{d: d, agent: agent}, Fields{{"agent", agent.Name()}, {"endpoint", ""}, agentParamsField(agent)}, nil
}

// vllmMaxID bounds engine and request ids (vLLM's are uuids with a
// prefix and suffix, under 100 bytes): a hold keeps its id for as long
// as the request is held, and every notification names it.
const vllmMaxID = 1024

// vllmID reads an engine or request id: a non-empty str of at most
// vllmMaxID bytes.
func vllmID(r *request, name string) (string, error) {
	s, err := r.str(name)
	if err != nil {
		return "", err
	}
	if s == "" || len(s) > vllmMaxID {
		return "", badValue(name, "%d bytes, want 1 to %d", len(s), vllmMaxID)
	}
	return s, nil
}

// vllmSeconds reads an optional positive number of seconds (int or
// float); 0 when absent.
func vllmSeconds(r *request, name string) (time.Duration, error) {
	v, ok := r.get(name)
	if !ok {
		return 0, nil
	}
	var f float64
	if x, ok := v.Float(); ok {
		f = x
	} else if n, ok := v.Int(); ok {
		f = float64(n)
	} else {
		return 0, wrongType(name, "number of seconds", v)
	}
	if !(f > 0 && f <= 1e9) {
		return 0, badValue(name, "%v is not a positive number of seconds", f)
	}
	return time.Duration(f * float64(time.Second)), nil
}

// vllmCacheOf reads the rank's KV cache (register_kv_caches) and
// translates every region into the sidecar's mapping; DRAM regions also
// get host views, which the decode needs to reorder blocks.
func vllmCacheOf(s *session, r *request, rk *rankEntry) (pull.Cache, error) {
	var c pull.Cache
	addrs, err := r.u64s("kv_caches_base_addr")
	if err != nil {
		return c, err
	}
	if len(addrs) == 0 {
		return c, badValue("kv_caches_base_addr", "empty")
	}
	regionLen, err := r.u64("region_len")
	if err != nil {
		return c, err
	}
	if c.NumBlocks, err = r.int("num_blocks"); err != nil {
		return c, err
	}
	if c.BlockSize, err = r.int("block_size"); err != nil {
		return c, err
	}
	if c.Layout, err = r.optStr("kv_cache_layout", pull.LayoutHND); err != nil {
		return c, err
	}
	if c.Layout != pull.LayoutHND && c.Layout != pull.LayoutNHD {
		return c, badValue("kv_cache_layout", "%q is neither HND nor NHD", c.Layout)
	}
	switch {
	case c.NumBlocks == 0:
		return c, errorf(CodeGeometry, "num_blocks is 0")
	case c.BlockSize == 0:
		return c, errorf(CodeGeometry, "block_size is 0")
	case regionLen == 0 || regionLen%uint64(c.NumBlocks) != 0:
		return c, errorf(CodeGeometry, "region_len %d is not a positive multiple of num_blocks %d", regionLen, c.NumBlocks)
	}
	if r.has("region_names") {
		if c.Names, err = r.strs("region_names"); err != nil {
			return c, err
		}
		if len(c.Names) != len(addrs) {
			return c, badValue("region_names", "%d names for %d regions of kv_caches_base_addr", len(c.Names), len(addrs))
		}
		for i, n := range c.Names {
			if n == "" || len(n) > vllm.MaxRegionName {
				return c, badValue("region_names", "[%d] is %d bytes, want 1 to %d", i, len(n), vllm.MaxRegionName)
			}
		}
	}
	for i, a := range addrs {
		what := fmt.Sprintf("kv_caches_base_addr[%d]", i)
		local, reg, err := s.useRegion(rk, what, a, regionLen)
		if err != nil {
			return c, err
		}
		kind, dev := reg.PluginKind(), uint64(reg.Device)
		if i == 0 {
			c.Kind, c.DeviceID = kind, dev
		} else if kind != c.Kind || dev != c.DeviceID {
			return c, errorf(CodeBadRegion, "%s: %s memory on device %d, but region 0 is %s on device %d", what, kind, dev, c.Kind, c.DeviceID)
		}
		c.Regions = append(c.Regions, pull.Region{Addr: uint64(local), Len: regionLen})
		if reg.Kind == engmem.DRAM { // host memory, whatever it is registered as
			b, err := s.mem.bytes(a, regionLen)
			if err != nil {
				return c, err
			}
			c.Host = append(c.Host, b)
		}
	}
	return c, nil
}

// vllmAPIError turns a hub refusal into the API's error.
func vllmAPIError(err error) error {
	if ve, ok := err.(*vllmError); ok {
		return &Error{Code: ve.Code, Message: ve.Msg}
	}
	return err
}

// opVLLMHold is vLLM's request_finished on the prefill.
func opVLLMHold(s *session, r *request) (Fields, error) {
	hub := vllmHubOf(s)
	engineID, err := vllmID(r, "engine_id")
	if err != nil {
		return nil, err
	}
	requestID, err := vllmID(r, "request_id")
	if err != nil {
		return nil, err
	}
	blocks, err := r.pages("block_ids")
	if err != nil {
		return nil, err
	}
	if len(blocks) > vllmMaxBlockIDs {
		return nil, badValue("block_ids", "%d ids, at most %d", len(blocks), vllmMaxBlockIDs)
	}
	// request.num_computed_tokens, which version 6's params carry.
	numTokens, err := r.optInt("num_tokens", 0)
	if err != nil {
		return nil, err
	}
	if numTokens < 0 || numTokens > math.MaxInt32 {
		return nil, badValue("num_tokens", "%d is not a token count", numTokens)
	}
	vllmWatch(s, hub)
	p, gen, herr := hub.hold(s, engineID, requestID, blocks)
	if herr != nil {
		return nil, vllmAPIError(herr)
	}
	if len(blocks) > 0 {
		p.RemoteNumTokens = numTokens
	}
	return Fields{{"kv_transfer_params", vllmParamsMsg(p, gen)}}, nil
}

// vllmParamsMsg is p as vLLM's request_finished dict of generation gen
// (encodeVLLMParams), as a value the reply encoder writes.
func vllmParamsMsg(p pull.KVTransferParams, gen *vllm.Generation) msgpack.Value {
	var e msgpack.Encoder
	encodeVLLMParams(&e, p, gen)
	v, err := msgpack.Decode(e.Bytes())
	if err != nil {
		panic("serve: kv_transfer_params do not decode: " + err.Error())
	}
	return v
}

// opVLLMRelease is the scheduler's abort of a held request.
func opVLLMRelease(s *session, r *request) (Fields, error) {
	hub := vllmHubOf(s)
	engineID, err := vllmID(r, "engine_id")
	if err != nil {
		return nil, err
	}
	requestID, err := vllmID(r, "request_id")
	if err != nil {
		return nil, err
	}
	if err := hub.release(s, engineID, requestID); err != nil {
		return nil, vllmAPIError(err)
	}
	return Fields{}, nil
}

// decodeRequest reads what every decode request op names first: a vLLM
// decode rank of this connection and the request_id.
func decodeRequest(s *session, r *request) (*vllmDecodeImpl, string, error) {
	_, d, err := rankAs[*vllmDecodeImpl](s, r)
	if err != nil {
		return nil, "", err
	}
	requestID, err := vllmID(r, "request_id")
	if err != nil {
		return nil, "", err
	}
	return d, requestID, nil
}

// opVLLMRead is the decode worker's start_load_kv for one request.
func opVLLMRead(s *session, r *request) (Fields, error) {
	d, requestID, err := decodeRequest(s, r)
	if err != nil {
		return nil, err
	}
	blocks, err := r.pages("block_ids")
	if err != nil {
		return nil, err
	}
	if len(blocks) > vllmMaxBlockIDs {
		return nil, badValue("block_ids", "%d ids, at most %d", len(blocks), vllmMaxBlockIDs)
	}
	pv, ok := r.get("kv_transfer_params")
	if !ok {
		return nil, missing("kv_transfer_params")
	}
	if pv.Kind != msgpack.Map {
		return nil, wrongType("kv_transfer_params", "map", pv)
	}
	// What is inside is vLLM's, passed through by the proxy: a read whose
	// params cannot drive a pull fails (read event, every block invalid),
	// as vLLM's connector refuses to pull with them.
	params, perr := vllmParamsOf(pv, d.d.gen)
	if rerr := d.d.read(requestID, params, perr, blocks); rerr != nil {
		return nil, vllmAPIError(rerr)
	}
	return Fields{}, nil
}

// opVLLMWatch is vLLM's on_new_request on a decode (versions with
// leases): renew the prefill's lease of a request queued for a later
// read (pull.Receiver.Watch).
func opVLLMWatch(s *session, r *request) (Fields, error) {
	d, requestID, err := decodeRequest(s, r)
	if err != nil {
		return nil, err
	}
	pv, ok := r.get("kv_transfer_params")
	if !ok {
		return nil, missing("kv_transfer_params")
	}
	params, perr := vllmParamsOf(pv, d.d.gen)
	if perr != nil {
		return nil, errorf(CodeBadRequest, "%v", perr)
	}
	switch err := d.d.rcv.Watch(requestID, params); {
	case errors.Is(err, pull.ErrNoLease):
		return nil, errorf(CodeUnsupported, "%v", err)
	case errors.Is(err, pull.ErrInvalidParams):
		return nil, errorf(CodeBadRequest, "%v", err)
	case err != nil:
		return nil, errorf(CodeLimit, "%v", err)
	}
	return Fields{}, nil
}

// opVLLMUnwatch is vLLM's _stop_heartbeat: the request finished or was
// aborted before its read.
func opVLLMUnwatch(s *session, r *request) (Fields, error) {
	d, requestID, err := decodeRequest(s, r)
	if err != nil {
		return nil, err
	}
	d.d.rcv.Unwatch(requestID)
	return Fields{}, nil
}
