package pullworker

import (
	"bytes"
	"encoding/json"
	"os/exec"
	"testing"

	"github.com/kvhost/kvhost/host/wire/vllm"
)

// kvhost's compatibility hash equals vLLM's compute_nixl_compatibility_hash
// (vLLM's vllm/distributed/kv_transfer/kv_connector/v1/nixl_connector.py),
// computed by a Python transcription of it from a Hugging Face config, for
// MLA and MHA models. For MLA vLLM hashes the model's total KV heads
// (DeepSeek-V3: 128), not the single latent head a rank's cache holds.
func TestCompatHashMatchesVLLM(t *testing.T) {
	type pyCase struct {
		Model            string         `json:"model"`
		DType            string         `json:"dtype"`
		HFConfig         map[string]any `json:"hf_config"`
		UseMLA           bool           `json:"use_mla"`
		VLLMVersion      string         `json:"vllm_version"`
		ConnectorVersion int            `json:"connector_version"`
		CacheDType       string         `json:"cache_dtype"`
		AttnBackendName  string         `json:"attn_backend_name"`
	}
	cases := []struct {
		m  Model
		hf map[string]any
	}{
		{Model{Name: "deepseek-ai/DeepSeek-V3", VLLMVersion: DefaultVLLMVersion, DType: "bfloat16", CacheDType: "auto", MLA: true,
			Layers: 61, KVHeads: 128, HeadDim: 576},
			map[string]any{"num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
				"kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "hidden_size": 7168}},
		{Model{Name: "deepseek-ai/DeepSeek-V2-Lite", VLLMVersion: "0.11.0", DType: "float16", CacheDType: "fp8", MLA: true,
			AttnBackend: "TRITON_MLA", Layers: 27, KVHeads: 16, HeadDim: 576},
			map[string]any{"num_hidden_layers": 27, "num_attention_heads": 16, "num_key_value_heads": 16,
				"kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "hidden_size": 2048}},
		{Model{Name: "Qwen/Qwen3-8B", VLLMVersion: DefaultVLLMVersion, DType: "bfloat16", CacheDType: "auto",
			Layers: 36, KVHeads: 8, HeadDim: 128},
			map[string]any{"num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "hidden_size": 4096}},
	}
	var spec []pyCase
	for _, c := range cases {
		if err := c.m.Validate(); err != nil {
			t.Fatalf("%s: %v", c.m.Name, err)
		}
		spec = append(spec, pyCase{Model: c.m.Name, DType: "torch." + c.m.DType, HFConfig: c.hf, UseMLA: c.m.MLA,
			VLLMVersion: c.m.VLLMVersion, ConnectorVersion: vllm.ConnectorVersion, CacheDType: c.m.CacheDType,
			AttnBackendName: c.m.Backend()})
	}
	in, _ := json.Marshal(spec)
	cmd := exec.Command("/usr/bin/python3", "testdata/vllm_compat_hash.py")
	cmd.Stdin = bytes.NewReader(in)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("testdata/vllm_compat_hash.py (needs /usr/bin/python3): %v\n%s", err, stderr.String())
	}
	var want []string
	if err := json.Unmarshal(out, &want); err != nil || len(want) != len(cases) {
		t.Fatalf("python output %q: %v", out, err)
	}
	for i, c := range cases {
		if got := c.m.CompatHash(); got != want[i] {
			t.Errorf("%s (MLA %v): kvhost hash %s, vLLM's %s", c.m.Name, c.m.MLA, got, want[i])
		}
	}
}
