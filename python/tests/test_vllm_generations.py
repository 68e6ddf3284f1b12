"""What kvhost.vllm tells the sidecar about the engine's NIXL connector
wire (open_rank's ``compat``), and the settings that differ between vLLM
versions, without a sidecar.

The factor names per generation are vLLM's compute_nixl_compatibility_hash
(kvhost.vllm.generations names the files); when vLLM is importable the
factors are caught from vLLM's own function, which the fake ``vllm``
modules below stand in for, one per signature vLLM has had.
"""

from __future__ import annotations

import hashlib
import json
import sys
import types

import pytest

from kvhost import vllm as kvllm
from kvhost import vllm_standins as vs
from kvhost.vllm import generations, settings
from kvhost.vllm.scheduler import single_group

BASE = {"vllm_version", "nixl_connector_version", "model", "dtype", "num_kv_heads", "head_size",
        "num_hidden_layers", "attn_backend_name", "cache_dtype"}


def cfg(**extra):
    ex = {"kvhost_attn_backend": "FLASH_ATTN", "kvhost_vllm_version": "0.13.0"}
    ex.update(extra)
    return vs.make_config("e", "kv_producer", "ipc:///nonexistent", extra=ex)


def test_generation_2_is_vllm_0_13s_nine_factors():
    f = settings.compat_factors(cfg(), "FLASH_ATTN")
    assert set(f) == BASE
    assert f["nixl_connector_version"] == 2 and f["vllm_version"] == "0.13.0"
    assert f["num_kv_heads"] == 8 and f["head_size"] == 128 and f["num_hidden_layers"] == 16
    assert f["dtype"] == "torch.bfloat16" and f["cache_dtype"] == "auto" and f["model"] == "kvhost/demo-llama"


@pytest.mark.parametrize("gen,extra", [
    (6, {"cross_layers_blocks": False, "is_hma_enabled": True, "speculative_config": None}),
    (10, {"is_hma_enabled": True, "speculative_config": None, "transfer_mode": "pull"}),
    # 11 and 12: vllm-project/vllm nixl/metadata.py @ 02cfb534 hashes 10's
    # factors (11 and 12 changed NixlAgentMetadata only).
    (11, {"is_hma_enabled": True, "speculative_config": None, "transfer_mode": "pull"}),
    (12, {"is_hma_enabled": True, "speculative_config": None, "transfer_mode": "pull"}),
])
def test_later_generations_add_vllms_factors(gen, extra):
    f = settings.compat_factors(cfg(kvhost_nixl_connector_version=gen, kvhost_vllm_version="0.21.0"), "FLASH_ATTN")
    assert set(f) == BASE | set(extra)
    assert f["nixl_connector_version"] == gen and f["vllm_version"] == "0.21.0"
    for k, v in extra.items():
        assert f[k] == v and type(f[k]) is type(v), k


def test_is_hma_enabled_follows_the_scheduler_config():
    c = cfg(kvhost_nixl_connector_version=6)
    c.scheduler_config.disable_hybrid_kv_cache_manager = True
    assert settings.compat_factors(c, "X")["is_hma_enabled"] is False


def test_speculative_factors_for_an_eagle_draft():
    c = cfg(kvhost_nixl_connector_version=12)
    draft = types.SimpleNamespace(model="draft", revision="r1", code_revision=None,
                                  hf_config=types.SimpleNamespace(eagle_aux_hidden_state_layer_ids=(1, 5)))
    c.speculative_config = types.SimpleNamespace(use_eagle=lambda: True, draft_model_config=draft, method="eagle3",
                                                 parallel_drafting=False, kv_cache_dtype=None)
    f = settings.compat_factors(c, "X")["speculative_config"]
    assert f == {"method": "eagle3", "model": "draft", "revision": "r1", "code_revision": None,
                 "parallel_drafting": False, "kv_cache_dtype": "auto", "auxiliary_layer_ids": [1, 5]}
    c.speculative_config.use_eagle = lambda: False  # ngram & co. share no KV
    assert settings.compat_factors(c, "X")["speculative_config"] is None


@pytest.mark.parametrize("version,gen", [("0.13.0", 2), ("0.13.1", 2), ("v0.13.2.dev3+g0123abc", 2), (None, 2)])
def test_generation_for_version(version, gen):
    assert generations.generation_for_version(version) == gen


@pytest.mark.parametrize("version", ["0.21.0", "0.12.0", "nonsense"])
def test_unknown_release_is_refused_with_what_to_set(version):
    with pytest.raises(generations.UnknownGeneration, match="kvhost_nixl_connector_version"):
        settings.compat_factors(cfg(kvhost_vllm_version=version), "X")


@pytest.mark.parametrize("gen", [7, 13])
def test_unknown_generation_is_refused(gen):
    with pytest.raises(generations.UnknownGeneration) as ei:
        settings.compat_factors(cfg(kvhost_nixl_connector_version=gen), "X")
    msg = str(ei.value)
    assert "generation %d" % gen in msg and "known: [2, 6, 10, 11, 12]" in msg, msg


def test_compatibility_hash_is_vllms_hash_factors():
    f = settings.compat_factors(cfg(), "FLASH_ATTN")
    assert generations.compatibility_hash(f) == hashlib.sha256(json.dumps(f, sort_keys=True).encode()).hexdigest()
    g = dict(f, model="other")
    assert generations.compatibility_hash(g) != generations.compatibility_hash(f)


# ---- factors caught from vLLM's own compute_nixl_compatibility_hash ----

def _fake_vllm(monkeypatch, module, compute, version="9.9.9"):
    """Fake vllm, vllm.config.utils (hash_factors as vLLM's) and the NIXL
    module holding compute_nixl_compatibility_hash."""

    def hash_factors(items):
        return hashlib.sha256(json.dumps(items, sort_keys=True).encode()).hexdigest()

    mods = {"vllm": types.ModuleType("vllm"), "vllm.config": types.ModuleType("vllm.config"),
            "vllm.config.utils": types.ModuleType("vllm.config.utils"), module: types.ModuleType(module)}
    mods["vllm"].__version__ = version
    mods["vllm.config.utils"].hash_factors = hash_factors
    mods[module].compute_nixl_compatibility_hash = compute
    mods[module].NIXL_CONNECTOR_VERSION = 77
    for name, m in mods.items():
        monkeypatch.setitem(sys.modules, name, m)


def _factors(vllm_config, name, **more):
    mc = vllm_config.model_config
    return dict({"vllm_version": "9.9.9", "nixl_connector_version": 77, "model": mc.model,
                 "attn_backend_name": name}, **more)


def compute_013(vllm_config, attn_backend_name):
    from vllm.config.utils import hash_factors  # type: ignore  (at each call, as vLLM)

    return hash_factors(_factors(vllm_config, attn_backend_name))


def compute_gen6(vllm_config, attn_backend_name, cross_layers_blocks):
    from vllm.config.utils import hash_factors  # type: ignore

    return hash_factors(_factors(vllm_config, attn_backend_name, cross_layers_blocks=cross_layers_blocks,
                                 speculative_config={"auxiliary_layer_ids": (3, 4)}))


def compute_gen12(vllm_config, attn_backend_name, transfer_mode="pull"):
    from vllm.config.utils import hash_factors  # type: ignore

    return hash_factors(_factors(vllm_config, attn_backend_name, transfer_mode=transfer_mode))


@pytest.mark.parametrize("module,compute,want_extra", [
    ("vllm.distributed.kv_transfer.kv_connector.v1.nixl_connector", compute_013, {}),
    ("vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata", compute_gen6,
     {"cross_layers_blocks": False, "speculative_config": {"auxiliary_layer_ids": [3, 4]}}),
    ("vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata", compute_gen12, {"transfer_mode": "pull"}),
])
def test_factors_are_caught_from_vllm(monkeypatch, module, compute, want_extra):
    _fake_vllm(monkeypatch, module, compute)
    c = vs.make_config("e", "kv_producer", "ipc:///x", extra={"kvhost_attn_backend": "FLASHINFER"})
    del c.kv_transfer_config.kv_connector_extra_config["kvhost_vllm_version"]
    f = settings.compat_factors(c, "FLASHINFER")
    assert f == dict(_factors(c, "FLASHINFER"), **want_extra)
    # vLLM's hash_factors is vLLM's again afterwards.
    assert sys.modules["vllm.config.utils"].hash_factors.__name__ == "hash_factors"


def test_a_configured_generation_wins_over_vllm(monkeypatch):
    _fake_vllm(monkeypatch, "vllm.distributed.kv_transfer.kv_connector.v1.nixl_connector", compute_013)
    f = settings.compat_factors(cfg(kvhost_nixl_connector_version=2), "X")
    assert f["nixl_connector_version"] == 2 and set(f) == BASE


def test_a_hash_that_is_not_hash_factors_is_refused(monkeypatch):
    def compute(vllm_config, attn_backend_name):
        from vllm.config.utils import hash_factors  # type: ignore

        hash_factors({"a": 1})
        return "not-that-hash"

    _fake_vllm(monkeypatch, "vllm.distributed.kv_transfer.kv_connector.v1.nixl_connector", compute)
    with pytest.raises(RuntimeError, match="sha256"):
        generations.factors_from_vllm(cfg(), "X")


def test_without_vllm_nothing_is_caught():
    assert "vllm" not in sys.modules
    assert generations.factors_from_vllm(cfg(), "X") is None


# ---- the attention backend selector: moved and changed in v0.20 ----

class _Backend:
    @staticmethod
    def get_name():
        return "FLASH_ATTN"


def test_selector_of_0_13_gets_block_size():
    seen = {}

    def get_attn_backend(head_size, dtype, kv_cache_dtype, block_size, use_mla=False, has_sink=False):
        seen.update(head_size=head_size, dtype=dtype, kv_cache_dtype=kv_cache_dtype, block_size=block_size,
                    use_mla=use_mla)
        return _Backend

    c = cfg(kvhost_attn_backend=None)
    assert settings.attn_backend_name(c, selector=get_attn_backend) == "FLASH_ATTN"
    assert seen == {"head_size": 128, "dtype": "torch.bfloat16", "kv_cache_dtype": "auto", "block_size": 16,
                    "use_mla": False}


def test_selector_of_v0_20_gets_no_block_size():
    seen = {}

    def get_attn_backend(head_size, dtype, kv_cache_dtype, use_mla=False, has_sink=False, use_sparse=False,
                         attn_type=None, num_heads=None):
        seen.update(head_size=head_size, use_mla=use_mla)
        return _Backend

    assert settings.attn_backend_name(cfg(kvhost_attn_backend=None), selector=get_attn_backend) == "FLASH_ATTN"
    assert seen == {"head_size": 128, "use_mla": False}


def test_selector_wanting_more_is_refused_with_what_to_set():
    def get_attn_backend(head_size, dtype, kv_cache_dtype, something_new):
        return _Backend

    with pytest.raises(ValueError, match="kvhost_attn_backend"):
        settings.attn_backend_name(cfg(kvhost_attn_backend=None), selector=get_attn_backend)


# ---- side channel, roles, KV cache groups ----

def test_side_channel_port_adds_the_dp_index(monkeypatch):
    monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_PORT", "5600")
    monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_HOST", "10.0.0.7")
    c = cfg()
    del c.kv_transfer_config.kv_connector_extra_config["kvhost_side_channel_port"]
    del c.kv_transfer_config.kv_connector_extra_config["kvhost_side_channel_host"]
    c.parallel_config.data_parallel_index, c.parallel_config.data_parallel_rank = 3, 1
    assert settings.side_channel(c) == ("10.0.0.7", 5603)  # current vLLM: data_parallel_index
    c.parallel_config = types.SimpleNamespace(data_parallel_rank=2)  # vLLM 0.13: no index
    assert settings.side_channel(c) == ("10.0.0.7", 5602)


@pytest.mark.parametrize("kv_role,extra,want", [
    ("kv_producer", {}, ("prefill",)),
    ("kv_consumer", {}, ("decode",)),
    ("kv_both", {}, ("prefill", "decode")),
    ("kv_both", {"kvhost_role": "decode"}, ("decode",)),
    ("kv_consumer", {"kvhost_role": "both"}, ("prefill", "decode")),
])
def test_rank_roles(kv_role, extra, want):
    c = vs.make_config("e", kv_role, "ipc:///x", extra=extra)
    assert settings.rank_roles(c) == want


@pytest.mark.parametrize("kv_role,extra", [("kv_sender", {}), ("kv_both", {"kvhost_role": "sideways"})])
def test_bad_roles_are_refused(kv_role, extra):
    with pytest.raises(ValueError, match="kv_role|kvhost_role"):
        settings.rank_roles(vs.make_config("e", kv_role, "ipc:///x", extra=extra))


@pytest.mark.parametrize("role", [kvllm.KVConnectorRole.SCHEDULER, kvllm.KVConnectorRole.WORKER])
def test_hybrid_kv_cache_is_refused_with_how_to_run(role):
    c = vs.make_config("e", "kv_both", "ipc:///nonexistent", tp_rank=0)
    with pytest.raises(ValueError, match="--disable-hybrid-kv-cache-manager"):
        kvllm.KvhostConnector(c, role, vs.kv_cache_config(64, 4, groups=2))


def test_mamba_state_is_refused():
    class MambaSpec:  # vllm/v1/kv_cache_interface.py's, by name
        pass

    kcc = vs.kv_cache_config(64, 4)
    kcc.kv_cache_groups[0].kv_cache_spec = MambaSpec()
    with pytest.raises(ValueError, match="Mamba"):
        kvllm.KvhostConnector(vs.make_config("e", "kv_both", "ipc:///nonexistent", tp_rank=0),
                              kvllm.KVConnectorRole.SCHEDULER, kcc)


def test_connector_is_a_supports_hma():
    assert issubclass(kvllm.KvhostConnector, kvllm.SupportsHMA)


def test_single_group():
    assert single_group(([1, 2],), "x") == [1, 2]
    assert single_group([3], "x") == [3]
    with pytest.raises(ValueError, match="2 KV cache groups"):
        single_group(([1], [2]), "x")


# ---- kv_transfer_params pass through unchanged, whatever their generation ----

class _StubClient:
    """Records what the worker asks the sidecar; answers nothing."""

    lost = None
    generation = 1

    def __init__(self):
        self.reads = []

    def add_listener(self, fn):
        pass

    def read(self, rank, request_id, kv_transfer_params, block_ids):
        self.reads.append((rank, request_id, kv_transfer_params, block_ids))

    def read_nowait(self, rank, request_id, kv_transfer_params, block_ids, on_error):
        self.read(rank, request_id, kv_transfer_params, block_ids)


@pytest.mark.parametrize("remote_block_ids", [[7, 8, 9], [[7, 8, 9]]], ids=["gen2-flat", "gen6-per-group"])
def test_kv_transfer_params_reach_the_sidecar_unchanged(remote_block_ids):
    """Generation 6 on, remote_block_ids is one list per KV cache group and
    more keys come along (remote_num_tokens, pp_size, ...): the connector
    passes the dict as the prefill made it, and only the local block ids
    (one group, flat) are its own."""
    from kvhost.vllm.scheduler import KvhostConnectorScheduler
    from kvhost.vllm.worker import KvhostConnectorWorker

    c = vs.make_config("d", "kv_consumer", "ipc:///x", tp_rank=0)
    params = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": remote_block_ids,
              "remote_engine_id": "p", "remote_request_id": "r", "remote_host": "10.0.0.1", "remote_port": 5600,
              "tp_size": 1, "remote_num_tokens": 12, "pp_size": 1, "remote_blocks_expiry_time": None}
    sent = json.loads(json.dumps(params))
    sched = KvhostConnectorScheduler(c, "d", client=_StubClient())
    req = vs.Request("d-r", list(range(12)), params)
    assert sched.get_num_new_matched_tokens(req, 4) == (8, True)
    sched.update_state_after_alloc(req, vs.kv_cache_blocks([3, 4, 5], hashed=1), 8)
    meta = sched.build_connector_meta(vs.SchedulerOutput())
    client = _StubClient()
    w = KvhostConnectorWorker(c, "d", client=client)
    w.rank = 9
    w.start_load_kv(meta)
    assert client.reads == [(9, "d-r", sent, [4, 5])]
