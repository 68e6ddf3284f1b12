package serve

import (
	"strconv"
	"strings"

	"github.com/kvhost/kvhost/host/internal/msgpack"
	"github.com/kvhost/kvhost/host/plugin"
)

// Bounds of open_rank's agent_params: an engine tunes a few backend knobs
// (num_threads, num_workers, ...), it does not ship a configuration file.
const (
	maxRankAgentParams = 16
	maxAgentParamKey   = 64
	maxAgentParamValue = 1024
)

// rankAgentParams are the agent parameters of the rank open_rank r opens:
// the sidecar's (--agent-param), each key that r's optional agent_params
// map sets taking its value from there (a str, or an int written in
// decimal). The host's per-side defaults (plugin.ForSide) are added where
// the agent is created, for keys neither sets.
func rankAgentParams(s *session, r *request) ([]plugin.Param, error) {
	base := s.srv.cfg.AgentParams
	v, ok := r.get("agent_params")
	if !ok {
		return base, nil
	}
	if v.Kind != msgpack.Map {
		return nil, wrongType("agent_params", "map", v)
	}
	if n := v.Len(); n > maxRankAgentParams {
		return nil, badValue("agent_params", "%d entries, at most %d", n, maxRankAgentParams)
	}
	var over []plugin.Param
	var bad error
	err := v.Each(func(key string, val msgpack.Value) bool {
		if key == "" || len(key) > maxAgentParamKey {
			bad = badValue("agent_params", "a key of %d bytes (want 1..%d)", len(key), maxAgentParamKey)
			return false
		}
		s, ok := val.Str()
		if !ok {
			i, isInt := val.Int()
			if !isInt {
				bad = badValue("agent_params", "%q: want str or int, got %v", key, val.Kind)
				return false
			}
			s = strconv.FormatInt(i, 10)
		}
		if len(s) > maxAgentParamValue {
			bad = badValue("agent_params", "%q: a value of %d bytes (at most %d)", key, len(s), maxAgentParamValue)
			return false
		}
		over = append(over, plugin.Param{Key: strings.Clone(key), Value: s}) // key aliases the frame
		return true
	})
	if err != nil {
		return nil, badValue("agent_params", "%v", err)
	}
	if bad != nil {
		return nil, bad
	}
	return plugin.MergeParams(base, over), nil
}

// agentParamsField is open_rank's reply field agent_params: every
// parameter the rank's agent was created with, the host's defaults
// included, so the engine can log what its transfers run with.
func agentParamsField(a *plugin.Agent) Field {
	f := Fields{}
	for _, kv := range a.Params() {
		f = append(f, Field{kv.Key, kv.Value})
	}
	return Field{"agent_params", f}
}
