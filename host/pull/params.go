package pull

import (
	"errors"
	"fmt"
	"net"
	"strconv"
)

// KVTransferParams is vLLM's kv_transfer_params as the NIXL connector reads
// and writes them (request_finished on the prefill, update_state_after_alloc
// on the decode). The proxy sends {"do_remote_decode": true} with the
// prefill request, passes the prefill's answer (this struct, filled) on to
// the decode, and the decode pulls. JSON field names are vLLM's.
type KVTransferParams struct {
	DoRemotePrefill bool `json:"do_remote_prefill"`
	DoRemoteDecode  bool `json:"do_remote_decode"`
	// RemoteBlockIDs are the prefill's block ids holding the request's KV,
	// in token order.
	RemoteBlockIDs []int32 `json:"remote_block_ids"`
	// RemoteEngineID is the prefill engine, checked against the handshake.
	RemoteEngineID string `json:"remote_engine_id"`
	// RemoteRequestID is the prefill's own request id: the decode's READ
	// notification names it ("{remote_request_id}:{tp_ratio}").
	RemoteRequestID string `json:"remote_request_id"`
	// RemoteHost and RemotePort locate the prefill's handshake side channel.
	RemoteHost string `json:"remote_host"`
	RemotePort int    `json:"remote_port"`
	// TPSize is the prefill engine's TP size; absent (0) means 1, as in the
	// reference (kv_transfer_params.get("tp_size", 1)).
	TPSize int `json:"tp_size,omitempty"`

	// Since version 6 (vllm.Generation.ParamsFields).
	//
	// RemoteNumTokens is the prefill's request.num_computed_tokens.
	RemoteNumTokens int `json:"remote_num_tokens,omitempty"`
	// RemoteBlockSize is the prefill's block size when the proxy says it
	// (0: unsaid; the handshake tells it).
	RemoteBlockSize int `json:"remote_block_size,omitempty"`
	// PPSize is the prefill's pipeline-parallel size (0: unsaid, 1).
	PPSize int `json:"pp_size,omitempty"`
}

// ErrInvalidParams marks kv_transfer_params a decode cannot pull with.
var ErrInvalidParams = errors.New("pull: invalid kv_transfer_params")

// RemoteTPSize is TPSize with vLLM's kv_connector/v1/nixl_connector.py's default of 1.
func (p *KVTransferParams) RemoteTPSize() int {
	if p.TPSize == 0 {
		return 1
	}
	return p.TPSize
}

// Endpoint is the prefill's handshake side channel, tcp://host:port (IPv6
// hosts bracketed, as vLLM's make_zmq_path does).
func (p *KVTransferParams) Endpoint() string {
	return "tcp://" + net.JoinHostPort(p.RemoteHost, strconv.Itoa(p.RemotePort))
}

// checkPull reports why p cannot drive a pull: vLLM's kv_connector/v1/nixl_connector.py needs
// do_remote_prefill, remote_block_ids and the four remote_* fields
// ("Got invalid KVTransferParams ... will not utilize KVTransfer").
func (p *KVTransferParams) checkPull() error {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%w: %s", ErrInvalidParams, fmt.Sprintf(format, args...))
	}
	switch {
	case !p.DoRemotePrefill:
		return bad("do_remote_prefill is false: the prefill did not hold blocks for this request")
	case len(p.RemoteBlockIDs) == 0:
		return bad("remote_block_ids is empty")
	case p.RemoteEngineID == "":
		return bad("remote_engine_id is missing")
	case p.RemoteRequestID == "":
		return bad("remote_request_id is missing")
	case p.RemoteHost == "":
		return bad("remote_host is missing")
	case p.RemotePort <= 0 || p.RemotePort > 65535:
		return bad("remote_port %d is not a TCP port", p.RemotePort)
	case p.TPSize < 0:
		return bad("tp_size %d is negative", p.TPSize)
	case p.PPSize < 0 || p.PPSize > 1:
		return bad("pp_size %d: kvhost reads from pipeline-parallel size 1 prefills only", p.PPSize)
	case p.RemoteBlockSize < 0:
		return bad("remote_block_size %d is negative", p.RemoteBlockSize)
	}
	for i, id := range p.RemoteBlockIDs {
		if id < 0 {
			return bad("remote_block_ids[%d] is %d", i, id)
		}
	}
	return nil
}
