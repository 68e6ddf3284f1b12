"""vLLM's NIXL compatibility hash, transcribed for kvhost's tests.

compute_nixl_compatibility_hash is vLLM's
vllm/distributed/kv_transfer/kv_connector/v1/nixl_connector.py; hash_factors
is vllm/config/utils.py; the ModelConfig methods it calls
(get_total_num_kv_heads, get_head_size, get_total_num_hidden_layers) are
vllm/config/model.py, cut to the branches the cases here reach. Note that
get_total_num_kv_heads has no MLA case: only get_num_kv_heads (per rank)
returns 1 for MLA.

Reads a JSON list of cases on stdin, prints a JSON list of hashes.
"""

import hashlib
import json
import sys
from types import SimpleNamespace


def hash_factors(items):
    return hashlib.sha256(json.dumps(items, sort_keys=True).encode()).hexdigest()


class ModelConfig:
    def __init__(self, model, dtype, hf_config, use_mla):
        self.model = model
        self.dtype = dtype  # str(torch.dtype), e.g. "torch.bfloat16"
        self.hf_text_config = SimpleNamespace(**hf_config)
        self.use_mla = use_mla

    @property
    def is_deepseek_mla(self):
        return getattr(self.hf_text_config, "kv_lora_rank", None) is not None

    def get_head_size(self):
        if self.is_deepseek_mla:
            qk_rope_head_dim = getattr(self.hf_text_config, "qk_rope_head_dim", 0)
            if self.use_mla:
                return self.hf_text_config.kv_lora_rank + qk_rope_head_dim
            qk_nope_head_dim = getattr(self.hf_text_config, "qk_nope_head_dim", 0)
            if qk_rope_head_dim and qk_nope_head_dim:
                return qk_rope_head_dim + qk_nope_head_dim
        if getattr(self.hf_text_config, "head_dim", None) is not None:
            return self.hf_text_config.head_dim
        return self.hf_text_config.hidden_size // self.hf_text_config.num_attention_heads

    def get_total_num_kv_heads(self):
        for attr in ["n_head_kv", "num_kv_heads", "num_key_value_heads", "multi_query_group_num"]:
            num_kv_heads = getattr(self.hf_text_config, attr, None)
            if num_kv_heads is not None:
                return num_kv_heads
        return self.hf_text_config.num_attention_heads

    def get_num_kv_heads(self, tensor_parallel_size):
        if self.use_mla:
            return 1  # when using MLA during decode it becomes MQA
        return max(1, self.get_total_num_kv_heads() // tensor_parallel_size)

    def get_total_num_hidden_layers(self):
        return self.hf_text_config.num_hidden_layers


def compute_nixl_compatibility_hash(vllm_version, connector_version, model_config, cache_dtype, attn_backend_name):
    factors = {
        "vllm_version": vllm_version,
        "nixl_connector_version": connector_version,
        "model": model_config.model,
        "dtype": str(model_config.dtype),
        "num_kv_heads": model_config.get_total_num_kv_heads(),
        "head_size": model_config.get_head_size(),
        "num_hidden_layers": model_config.get_total_num_hidden_layers(),
        "attn_backend_name": attn_backend_name,
        "cache_dtype": str(cache_dtype),
    }
    return hash_factors(factors)


out = []
for c in json.load(sys.stdin):
    mc = ModelConfig(c["model"], c["dtype"], c["hf_config"], c["use_mla"])
    out.append(compute_nixl_compatibility_hash(c["vllm_version"], c["connector_version"], mc,
                                               c["cache_dtype"], c["attn_backend_name"]))
print(json.dumps(out))
