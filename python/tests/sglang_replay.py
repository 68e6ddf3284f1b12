"""Replays of SGLang's own schedulers over kvhost.sglang's connector classes.

Each function below is one of SGLang's scheduler functions, reduced to
what it does with the KV manager, sender and receiver, in the order it does
it; the comment on each step names the upstream function (files under
python/sglang/srt/disaggregation/ in github.com/sgl-project/sglang) and the
commit it was read at. What the functions do besides (radix cache, memory
budgets, streaming, metrics) is left out; the engines' memory is numpy
views of shared memory, so every byte can be checked.

Two profiles: the SGLang of the reference connectors (SGLang's NIXL and MORI
conn.py in shared/reference: ``send(kv_indices, state_indices)``) and the
newest main SGLang (``finalize_bootstrap``, ``send(page_indices,
state_indices, num_kv_tokens=...)``). The upstream files read:

- prefill.py @ 000c2b942308ea5502978be73542016c230dba02:
  PrefillBootstrapQueue._init_kv_manager, add, pop_bootstrapped;
  send_kv_chunk; process_batch_result_disagg_prefill;
  process_disagg_prefill_inflight_queue.
- decode.py @ 0035ca42c2d615f77778ce3bf825d6ce6e089661:
  DecodePreallocQueue._init_kv_manager, add, _create_receiver_and_enqueue,
  _resolve_prefill_dp_rank, _ensure_prefill_info, _resolve_pending_reqs,
  _update_handshake_waiters, pop_preallocated; DecodeTransferQueue
  _poll_with_metadata_gate, pop_transferred, _commit_transfer_to_req.
- utils.py (shared/reference/sglang_disagg_utils.py.txt): TransferBackend,
  KVClassType, get_kv_class, poll_and_all_reduce, _apply_metadata_gate,
  kv_to_page_indices, kv_to_page_num, MetadataBuffers (output_ids,
  bootstrap_room).
- base/conn.py and common/conn.py @ 0094505da74125a31ceb354f37ae7a1b6a97d3f5:
  BaseKVSender (pop_decode_prefix_len, should_send_kv_chunk,
  get_transfer_metric), CommonKVManager (prefill_info_table,
  try_ensure_parallel_info), PrefillServerInfo.
- main's finalize_bootstrap (prefill.py; req.disagg_decode_prefix_len
  cached, then pop_decode_prefix_len and init) and send_kv_chunk's
  ``send(page_indices, state_indices, num_kv_tokens=...)`` as of
  e1c4db9621f7c4203ee9becd5d5456d4e6bf54f7 (that commit's prefill.py is not
  in the stored index: the call shape comes from documents quoting it, and
  FakeKVSender.send of the same era takes ``num_kv_tokens``).
"""

from __future__ import annotations

import enum
import time
from types import SimpleNamespace
from typing import Dict, List, Optional

import numpy as np

from kvhost import shm
from kvhost.sglang import launch
from kvhost.sglang import KVPoll, DisaggregationMode, StateType


class KVClassType(enum.Enum):
    """utils.py KVClassType (shared/reference/sglang_disagg_utils.py.txt)."""

    KVARGS = "kvargs"
    MANAGER = "manager"
    SENDER = "sender"
    RECEIVER = "receiver"
    BOOTSTRAP_SERVER = "bootstrap_server"


def get_kv_class(transfer_backend: str, class_type: KVClassType):
    """utils.py get_kv_class as kvhost.sglang.launch patches it: the kvhost
    backend resolves to kvhost.sglang's classes."""
    assert transfer_backend == launch.BACKEND
    return launch.kv_class(class_type)


PROFILES = {
    "reference": SimpleNamespace(name="reference", finalize=False, num_kv_tokens=False),
    "main": SimpleNamespace(name="main", finalize=True, num_kv_tokens=True),
}


# --------------------------------------------------------------------------
# The model and the engines' memory


class Model:
    """MHA KV (K and V per layer), and optionally hybrid state: a Mamba
    component (``mamba_tensors`` tensors of ``mamba_bytes`` per slot, one
    slot per request) and an SWA component (K and V of ``swa_layers``
    sliding-window layers, pages of the SWA pool; the window is
    ``window`` tokens)."""

    def __init__(self, layers=2, heads=4, head_bytes=16, page_size=4, hybrid=False):
        self.layers, self.heads, self.head_bytes, self.page_size = layers, heads, head_bytes, page_size
        self.hybrid = hybrid
        self.mamba_tensors, self.mamba_bytes, self.mamba_slots = 2, 96, 16
        self.swa_layers, self.swa_pages, self.window = 2, 48, 8

    def item_len(self, tp):
        return self.page_size * (self.heads // tp) * self.head_bytes


# More slots than a test has requests: slots are not reused, so each
# request's metadata can be checked after the run.
AUX_SLOTS = 16
AUX_ITEM = 64  # bytes per slot of each metadata buffer: output_ids (int32 x 16), bootstrap_room (int64 x 8)


class RankMem:
    """One TP rank's memory: KV pool with the two metadata buffers SGLang's
    connectors move (MetadataBuffers.output_ids and bootstrap_room), and
    the state tensors of a hybrid model, all filled with random bytes."""

    def __init__(self, model: Model, tp: int, pages: int, seed: int, register_as: Optional[str] = None):
        self.rng = np.random.default_rng(seed)
        self.kv = shm.KVPool(model.layers, pages, model.item_len(tp), aux_item_lens=[AUX_ITEM, AUX_ITEM],
                             aux_slots=AUX_SLOTS, register_as=register_as)
        for b in self.kv.kv:
            b[:] = self.rng.integers(0, 256, b.shape, dtype=np.uint8)
        for b in self.kv.aux:
            b[:] = 0
        self.output_ids = self.kv.aux[0].view(np.int32)  # (slots, 16)
        self.bootstrap_room = self.kv.aux[1].view(np.int64)  # (slots, 8)
        self.state: List[List[np.ndarray]] = []  # per component, per tensor: (items, item bytes)
        self.state_pools: List[shm.SharedPool] = []
        self.state_types: List = []
        self.state_ptrs: List[List[int]] = []
        self.state_lens: List[List[int]] = []
        self.state_items: List[List[int]] = []
        if model.hybrid:
            swa_item = model.item_len(tp)
            self._component(StateType.MAMBA, model.mamba_tensors, model.mamba_slots, model.mamba_bytes)
            self._component(StateType.SWA, 2 * model.swa_layers, model.swa_pages, swa_item)

    def _component(self, st, tensors, items, item_len):
        # SGLang's state tensors are GPU memory, and kvhost's state planner
        # (planner/state.go) moves them as such: the pool is registered with
        # the fake plugin as VRAM, which it models with host memory.
        pool = shm.SharedPool(tensors * items * item_len, register_as="vram")
        self.state_pools.append(pool)
        views = [pool.ndarray("uint8", (items, item_len), t * items * item_len) for t in range(tensors)]
        for v in views:
            v[:] = self.rng.integers(0, 256, v.shape, dtype=np.uint8)
        self.state.append(views)
        self.state_types.append(st)
        self.state_ptrs.append([pool.addr + t * items * item_len for t in range(tensors)])
        self.state_lens.append([items * item_len] * tensors)
        self.state_items.append([item_len] * tensors)

    def snapshot(self):
        return [b.copy() for b in self.kv.kv], [[t.copy() for t in c] for c in self.state]

    def close(self):
        self.output_ids = self.bootstrap_room = None
        self.state = []
        for p in self.state_pools:
            p.close()
        self.kv.close()


def server_args(tp, bootstrap_port, endpoint, page_size, variant="nixl"):
    """The ServerArgs fields the managers read, plus the launcher's
    kvhost_* settings (``--kvhost-control`` etc.)."""
    return SimpleNamespace(tp_size=tp, dp_size=1, enable_dp_attention=False, pp_size=1, page_size=page_size,
                           disaggregation_bootstrap_port=bootstrap_port, host="127.0.0.1", kv_cache_dtype="auto",
                           disaggregation_ib_device=None, kvhost_control=endpoint, kvhost_host="127.0.0.1",
                           kvhost_variant=variant)


def init_kv_manager(model: Model, mem: RankMem, tp: int, tp_rank: int, mode, args):
    """PrefillBootstrapQueue._init_kv_manager (prefill.py@000c2b94) and
    DecodePreallocQueue._init_kv_manager (decode.py@0035ca42): KVArgs from
    get_kv_class, its fields from the pools, setup_state_kv_args' state
    lists (one entry per state type), then the manager."""
    kv_args = get_kv_class(launch.BACKEND, KVClassType.KVARGS)()
    kv_args.engine_rank = tp_rank
    kv_args.pp_rank = 0
    kv_args.system_dp_rank = 0
    kv_args.prefill_start_layer = 0
    kv_args.kv_data_ptrs = list(mem.kv.kv_data_ptrs)
    kv_args.kv_data_lens = list(mem.kv.kv_data_lens)
    kv_args.kv_item_lens = list(mem.kv.kv_item_lens)
    kv_args.kv_head_num = model.heads // tp
    kv_args.total_kv_head_num = model.heads
    kv_args.page_size = model.page_size
    kv_args.aux_data_ptrs = list(mem.kv.aux_data_ptrs)
    kv_args.aux_data_lens = list(mem.kv.aux_data_lens)
    kv_args.aux_item_lens = list(mem.kv.aux_item_lens)
    kv_args.ib_device = args.disaggregation_ib_device
    kv_args.gpu_id = 0
    # utils.py setup_state_kv_args: one entry per state type.
    kv_args.state_types = list(mem.state_types)
    kv_args.state_data_ptrs = [list(x) for x in mem.state_ptrs]
    kv_args.state_data_lens = [list(x) for x in mem.state_lens]
    kv_args.state_item_lens = [list(x) for x in mem.state_items]
    kv_args.state_dim_per_tensor = [[] for _ in mem.state_types]
    manager_cls = get_kv_class(launch.BACKEND, KVClassType.MANAGER)
    return manager_cls(kv_args, mode, args, False)


# --------------------------------------------------------------------------
# Requests and the engines' allocators (replicated on every TP rank, as
# SGLang's are)


class Req:
    def __init__(self, room: int, prompt: int, chunk_tokens: int, decode_prefix_tokens: int = 0):
        self.rid = "req-%d" % room
        self.bootstrap_room = room
        self.bootstrap_host = "127.0.0.1"
        self.prompt = prompt  # len(origin_input_ids)
        self.chunk_tokens = chunk_tokens
        self.decode_prefix_tokens = decode_prefix_tokens  # decode's radix hit (page-aligned)
        self.output_id = 1000 + room
        # prefill side
        self.senders: List = []
        self.metadata_buffer_index = -1
        self.start_send_idx = 0
        self.fill = 0  # tokens prefilled so far (len(fill_ids))
        self.p_pages: Optional[np.ndarray] = None  # prefill KV pages of the prompt
        self.p_slot = -1  # prefill mamba slot (req_pool_idx)
        self.p_swa: Optional[np.ndarray] = None
        self.disagg_decode_prefix_len: Optional[int] = None
        self.prefill_state = "bootstrap"
        self.prefill_result = None
        self.prefill_reason = ""
        self.metrics: List = []
        # decode side
        self.receivers: List = []
        self.waiting_for_input = False
        self.d_meta = -1
        self.d_pages: Optional[np.ndarray] = None
        self.d_slot = -1
        self.d_swa: Optional[np.ndarray] = None
        self.decode_state = "pending"
        self.decode_result = None
        self.decode_reason = ""
        self.sent_chunks: List[int] = []  # pages of each send, for the test's checks


class Allocator:
    def __init__(self, n: int, seed: int):
        self.free = list(np.random.default_rng(seed).permutation(n))

    def alloc(self, k: int) -> np.ndarray:
        out, self.free = self.free[:k], self.free[k:]
        assert len(out) == k, "test pool too small"
        return np.array(out, dtype=np.int32)


def kv_to_page_indices(kv_indices: np.ndarray, page_size: int) -> np.ndarray:
    """utils.py kv_to_page_indices: the page of every page_size-th token."""
    if page_size == 1:
        return kv_indices
    return kv_indices[::page_size] // page_size


def kv_to_page_num(num_kv_indices: int, page_size: int) -> int:
    """utils.py kv_to_page_num: ceil."""
    return (num_kv_indices + page_size - 1) // page_size


def token_locs(pages: np.ndarray, page_size: int, n: int) -> np.ndarray:
    """req_to_token_pool.req_to_token[req_pool_idx, :n]: the KV slot of
    every token, in pages allocated whole."""
    locs = (pages[:, None].astype(np.int64) * page_size + np.arange(page_size)[None, :]).reshape(-1)
    return locs[:n]


def poll_and_all_reduce(pollers) -> int:
    """utils.py poll_and_all_reduce: MIN over the TP ranks (the gloo
    all_reduce)."""
    return min(int(p.poll()) for p in pollers)


# --------------------------------------------------------------------------
# Prefill: PrefillBootstrapQueue, send_kv_chunk, the inflight queue


class Prefill:
    def __init__(self, model: Model, tp: int, mems: List[RankMem], args: List, bootstrap_port: int, profile):
        self.model, self.tp, self.mems, self.profile = model, tp, mems, profile
        self.bootstrap_port = bootstrap_port
        # PrefillBootstrapQueue.__init__ -> _init_kv_manager (prefill.py@000c2b94)
        self.managers = [init_kv_manager(model, m, tp, r, DisaggregationMode.PREFILL, a)
                         for r, (m, a) in enumerate(zip(mems, args))]
        pages = mems[0].kv.num_pages
        self.pages = Allocator(pages, 1)
        self.meta = Allocator(AUX_SLOTS, 2)
        self.mamba = Allocator(model.mamba_slots, 3)
        self.swa = Allocator(model.swa_pages, 4)
        self.queue: List[Req] = []
        self.waiting: List[Req] = []
        self.inflight: List[Req] = []

    def add(self, req: Req):
        """PrefillBootstrapQueue.add (prefill.py@000c2b94): a sender per TP
        rank from get_kv_class, keyword arguments as SGLang passes them."""
        sender_cls = get_kv_class(launch.BACKEND, KVClassType.SENDER)
        req.senders = [sender_cls(mgr=mgr, bootstrap_addr="%s:%d" % (req.bootstrap_host, self.bootstrap_port),
                                  bootstrap_room=req.bootstrap_room, dest_tp_ranks=[r], pp_rank=0)
                       for r, mgr in enumerate(self.managers)]
        self.queue.append(req)

    def pop_bootstrapped(self) -> bool:
        """PrefillBootstrapQueue.pop_bootstrapped (prefill.py@000c2b94), or
        with the main profile finalize_bootstrap (prefill.py @ main:
        disagg_decode_prefix_len cached on the request)."""
        progressed = False
        for req in list(self.queue):
            poll = poll_and_all_reduce(req.senders)
            if poll == KVPoll.Bootstrapping:
                continue
            self.queue.remove(req)
            progressed = True
            if poll == KVPoll.Failed:
                for s in req.senders:
                    try:
                        s.failure_exception()
                    except Exception as e:  # SGLang logs it and aborts the request
                        req.prefill_reason = str(e)
                req.prefill_state, req.prefill_result = "done", KVPoll.Failed
                continue
            req.metadata_buffer_index = int(self.meta.alloc(1)[0])
            for r, s in enumerate(req.senders):
                if self.profile.finalize:
                    decode_prefix_len = getattr(req, "disagg_decode_prefix_len_%d" % r, None)
                    if decode_prefix_len is None:
                        decode_prefix_len = s.pop_decode_prefix_len()
                        setattr(req, "disagg_decode_prefix_len_%d" % r, decode_prefix_len)
                else:
                    decode_prefix_len = s.pop_decode_prefix_len()
                req.start_send_idx = decode_prefix_len
                req.disagg_decode_prefix_len = decode_prefix_len
                num_pages = kv_to_page_num(req.prompt - decode_prefix_len, self.model.page_size)
                s.init(num_pages, req.metadata_buffer_index)
            # The prompt's KV and state slots (the radix cache would give
            # the prefix; the allocator the rest).
            req.p_pages = self.pages.alloc(kv_to_page_num(req.prompt, self.model.page_size))
            if self.model.hybrid:
                req.p_slot = int(self.mamba.alloc(1)[0])
                req.p_swa = self.swa.alloc(self.swa_window_pages(req.prompt))
            self.waiting.append(req)
        return progressed

    def swa_window_pages(self, seq_len):
        ps = self.model.page_size
        start = max(0, seq_len - self.model.window)
        start = start // ps * ps
        return kv_to_page_num(seq_len - start, ps)

    def forward(self) -> bool:
        """The event loop's run_batch + process_batch_result: one chunk of
        every waiting request. A chunk that is not the last goes through
        process_prefill_chunk -> send_kv_chunk(req); the last through
        process_batch_result_disagg_prefill (set output id, inflight queue,
        send_kv_chunk(req, last_chunk=True)) (prefill.py@000c2b94)."""
        progressed = False
        for req in list(self.waiting):
            req.fill = min(req.prompt, req.fill + req.chunk_tokens)
            progressed = True
            if req.fill < req.prompt:
                self.send_kv_chunk(req)
            else:
                self.waiting.remove(req)
                self.inflight.append(req)
                self.send_kv_chunk(req, last_chunk=True)
                req.prefill_state = "inflight"
        return progressed

    def state_indices(self, req: Req):
        """send_kv_chunk's state payloads, one per kv_args.state_types
        entry: Mamba ``[req_index_to_mamba_index_mapping[req_pool_idx]
        .cpu().numpy()]`` (a 0-d array in a list), SWA the window's pages."""
        out = []
        for st in self.managers[0].kv_args.state_types:
            if st == StateType.MAMBA:
                out.append([np.array(req.p_slot, dtype=np.int32)])
            elif st == StateType.SWA:
                out.append(req.p_swa.copy())
            else:
                out.append(None)
        return out

    def send_kv_chunk(self, req: Req, last_chunk: bool = False):
        """send_kv_chunk (prefill.py@000c2b94), on every TP rank."""
        ps = self.model.page_size
        start_idx = req.start_send_idx
        end_idx = min(req.fill, req.prompt)
        if not last_chunk:
            end_idx = end_idx - end_idx % ps
        if end_idx < start_idx:
            return
        kv_indices = token_locs(req.p_pages, ps, req.prompt)[start_idx:end_idx]
        state_indices = None
        if last_chunk:
            # disagg_metadata_buffers.set_buf(req): output id and room.
            for m in self.mems:
                m.output_ids[req.metadata_buffer_index, 0] = req.output_id
                m.bootstrap_room[req.metadata_buffer_index, 0] = req.bootstrap_room
            state_indices = self.state_indices(req) if self.model.hybrid else []
        page_indices = kv_to_page_indices(kv_indices, ps)
        sent = False
        for s in req.senders:
            if not s.should_send_kv_chunk(len(page_indices), last_chunk):
                continue
            if self.profile.num_kv_tokens:
                s.send(page_indices, state_indices, num_kv_tokens=end_idx - start_idx)
            else:
                s.send(page_indices, state_indices)
            sent = True
        if not sent:
            return
        req.sent_chunks.append(len(page_indices))
        req.start_send_idx = end_idx

    def process_inflight_queue(self) -> bool:
        """process_disagg_prefill_inflight_queue (prefill.py@000c2b94)."""
        progressed = False
        for req in list(self.inflight):
            poll = poll_and_all_reduce(req.senders)
            if poll in (KVPoll.WaitingForInput, KVPoll.Transferring):
                continue
            self.inflight.remove(req)
            progressed = True
            if poll == KVPoll.Success:
                for s in req.senders:
                    if hasattr(s, "clear"):
                        s.clear()
                req.prefill_result = KVPoll.Success
                # metrics of requests not aborted, from every rank's sender
                req.metrics = [s.get_transfer_metric() for s in req.senders
                               if not getattr(getattr(s, "kv_mgr", None), "is_dummy_cp_rank", False)]
            else:
                assert poll == KVPoll.Failed, poll
                for s in req.senders:
                    try:
                        s.failure_exception()
                    except Exception as e:
                        req.prefill_reason = str(e)
                req.prefill_result = KVPoll.Failed
            req.prefill_state = "done"
        return progressed

    def close(self):
        for m in self.managers:
            m.close()


# --------------------------------------------------------------------------
# Decode: DecodePreallocQueue, DecodeTransferQueue


class Decode:
    def __init__(self, model: Model, tp: int, mems: List[RankMem], args: List, profile):
        self.model, self.tp, self.mems, self.profile = model, tp, mems, profile
        # DecodePreallocQueue.__init__ -> _init_kv_manager (decode.py@0035ca42)
        self.managers = [init_kv_manager(model, m, tp, r, DisaggregationMode.DECODE, a)
                         for r, (m, a) in enumerate(zip(mems, args))]
        self.pages = Allocator(mems[0].kv.num_pages, 11)
        self.meta = Allocator(AUX_SLOTS, 12)
        self.mamba = Allocator(model.mamba_slots, 13)
        self.swa = Allocator(model.swa_pages, 14)
        self.queue: List[Req] = []
        self.pending: List[Req] = []
        self.transfer: List[Req] = []
        self.prefix_pages: Dict[int, np.ndarray] = {}

    def add(self, req: Req, bootstrap_addr: str):
        """DecodePreallocQueue.add -> _create_receiver_and_enqueue
        (receivers by keyword, as SGLang passes them), then the fast path
        _resolve_prefill_dp_rank: no prefill info cached yet -> pending
        (decode.py@0035ca42)."""
        req.bootstrap_addr = bootstrap_addr
        receiver_cls = get_kv_class(launch.BACKEND, KVClassType.RECEIVER)
        req.receivers = [receiver_cls(mgr=mgr, bootstrap_addr=bootstrap_addr, bootstrap_room=req.bootstrap_room)
                         for mgr in self.managers]
        self.queue.append(req)
        dp_rank = self.resolve_prefill_dp_rank(req)
        if dp_rank is not None:
            for rc in req.receivers:
                rc.init(dp_rank)
            return
        self.pending.append(req)

    def resolve_prefill_dp_rank(self, req: Req) -> Optional[int]:
        """_resolve_prefill_dp_rank (decode.py@0035ca42): on every rank the
        scheduler reads its own manager's table."""
        infos = [mgr.prefill_info_table.get(req.bootstrap_addr) for mgr in self.managers]
        if any(i is None for i in infos):
            return None
        info = infos[0]
        if info.dp_size == 1:
            return 0
        if info.follow_bootstrap_room:
            return req.bootstrap_room % info.dp_size
        return None

    def resolve_pending_reqs(self):
        """_resolve_pending_reqs -> _ensure_prefill_info ->
        kv_manager.try_ensure_parallel_info(addr) per bootstrap address,
        then _resolve_prefill_dp_rank and kv_receiver.init(prefill_dp_rank)
        (decode.py@0035ca42)."""
        addrs: Dict[str, List[Req]] = {}
        for req in self.pending:
            addrs.setdefault(req.bootstrap_addr, []).append(req)
        remaining = []
        for addr, reqs in addrs.items():
            if not all(mgr.try_ensure_parallel_info(addr) for mgr in self.managers):
                remaining.extend(reqs)
                continue
            for req in reqs:
                dp_rank = self.resolve_prefill_dp_rank(req)
                assert dp_rank is not None, "kvhost's bootstrap server follows the room"
                for rc in req.receivers:
                    rc.init(dp_rank)
        self.pending = remaining

    def update_handshake_waiters(self):
        """_update_handshake_waiters (decode.py@0035ca42): skipped when every
        request waits for input and no receiver's conclude_state is Failed."""
        if not self.queue:
            return
        if all(r.waiting_for_input for r in self.queue) and not any(
                rc.conclude_state == KVPoll.Failed for r in self.queue for rc in r.receivers):
            return
        for req in list(self.queue):
            poll = poll_and_all_reduce(req.receivers)
            if poll == KVPoll.WaitingForInput:
                req.waiting_for_input = True
            elif poll == KVPoll.Failed:
                for rc in req.receivers:
                    try:
                        rc.failure_exception()
                    except Exception as e:
                        req.decode_reason = str(e)
                self.queue.remove(req)
                req.decode_state, req.decode_result = "done", KVPoll.Failed
                for rc in req.receivers:
                    rc.clear()

    def state_indices(self, req: Req):
        """pop_preallocated's payloads per kv_args.state_types entry
        (decode.py@0035ca42: _mamba_payload, _swa_payload)."""
        out = []
        for st in self.managers[0].kv_args.state_types:
            if st == StateType.MAMBA:
                out.append([np.array(req.d_slot, dtype=np.int32)])
            elif st == StateType.SWA:
                out.append(req.d_swa.copy())
            else:
                out.append(None)
        return out

    def pop_preallocated(self) -> bool:
        """pop_preallocated (decode.py@0035ca42): resolve pending, poll the
        handshakes, then for every request waiting for input preallocate,
        alloc a metadata slot and send_metadata(page_indices, index,
        state_indices, decode_prefix_len=total_prefix_len)."""
        self.resolve_pending_reqs()
        self.update_handshake_waiters()
        progressed = False
        ps = self.model.page_size
        for req in list(self.queue):
            if not req.waiting_for_input:
                continue
            self.queue.remove(req)
            progressed = True
            total_prefix_len = req.decode_prefix_tokens
            req.d_pages = self.pages.alloc(kv_to_page_num(req.prompt, ps))
            if total_prefix_len:
                self.prefix_pages[req.bootstrap_room] = req.d_pages[:total_prefix_len // ps]
            if self.model.hybrid:
                req.d_slot = int(self.mamba.alloc(1)[0])
                req.d_swa = self.swa.alloc(len_window_pages(self.model, req.prompt))
            state_indices = self.state_indices(req) if self.model.hybrid else []
            req.d_meta = int(self.meta.alloc(1)[0])
            for m in self.mems:  # a fresh metadata slot reads room 0 until prefill writes it
                m.bootstrap_room[req.d_meta] = 0
            kv_indices = token_locs(req.d_pages, ps, req.prompt)[total_prefix_len:req.prompt]
            page_indices = kv_to_page_indices(kv_indices, ps).astype(np.int32)
            for rc in req.receivers:
                rc.send_metadata(page_indices, req.d_meta, state_indices, decode_prefix_len=total_prefix_len)
            req.decode_state = "transfer"
            self.transfer.append(req)
        return progressed

    def pop_transferred(self) -> bool:
        """DecodeTransferQueue.pop_transferred -> _poll_with_metadata_gate
        (utils.py _apply_metadata_gate: Success whose metadata slot still
        reads room 0 counts as Transferring) -> all-reduce; Failed:
        failure_exception and clear; Success: _commit_transfer_to_req
        (checks the room in the metadata buffer) and clear()
        (decode.py@0035ca42)."""
        progressed = False
        for req in list(self.transfer):
            polls = []
            for m, rc in zip(self.mems, req.receivers):
                p = int(rc.poll())
                if p == KVPoll.Success and m.bootstrap_room[req.d_meta, 0] == 0:
                    p = int(KVPoll.Transferring)
                polls.append(p)
            poll = min(polls)
            if poll in (KVPoll.Bootstrapping, KVPoll.WaitingForInput, KVPoll.Transferring):
                continue
            self.transfer.remove(req)
            progressed = True
            if poll == KVPoll.Failed:
                for rc in req.receivers:
                    try:
                        rc.failure_exception()
                    except Exception as e:
                        req.decode_reason = str(e)
                req.decode_result = KVPoll.Failed
            else:
                assert poll == KVPoll.Success, poll
                for m in self.mems:
                    actual = int(m.bootstrap_room[req.d_meta, 0])
                    assert actual == req.bootstrap_room, "metadata of room %d in slot of room %d" % (
                        actual, req.bootstrap_room)
                req.decode_result = KVPoll.Success
            for rc in req.receivers:
                rc.clear()
            req.decode_state = "done"
        return progressed

    def close(self):
        for m in self.managers:
            m.close()


def len_window_pages(model: Model, seq_len: int) -> int:
    ps = model.page_size
    start = max(0, seq_len - model.window) // ps * ps
    return kv_to_page_num(seq_len - start, ps)


def run(prefill: Prefill, decode: Decode, reqs: List[Req], bootstrap_addr: str, timeout: float = 120.0):
    """Both event loops, one step each per round (event_loop_normal_disagg_
    prefill and the decode loop): requests arrive at both engines, then
    each loop polls its queues."""
    for req in reqs:
        prefill.add(req)
        decode.add(req, bootstrap_addr)
    deadline = time.monotonic() + timeout
    while any(r.prefill_result is None or r.decode_result is None for r in reqs):
        if time.monotonic() > deadline:
            raise AssertionError("timed out: %s" % [
                (r.bootstrap_room, r.prefill_state, r.prefill_reason, r.decode_state, r.decode_reason)
                for r in reqs if r.prefill_result is None or r.decode_result is None])
        progressed = decode.pop_preallocated()
        progressed |= decode.pop_transferred()
        progressed |= prefill.pop_bootstrapped()
        progressed |= prefill.forward()
        progressed |= prefill.process_inflight_queue()
        if not progressed:
            time.sleep(0.002)
