"""The engine demo's KV contents: what a prefill engine "computes" into
its pages and what every decode rank checks, byte for byte, in its own
memory after the transfer.

A request's KV is a function of (request seed, layer, K or V, global KV
head, token position, byte within the head) that knows nothing of pools,
page ids, TP layouts or transfers: a byte landing in the wrong page, head,
layer, request or offset (or not landing) fails the check, which names the
request, page, layer, head, token and byte.

    value = (A[layer, kv, head] + T[token] + B[byte]) mod 256

with A, T and B drawn per request from the request's seed (T over every
token of the request's pages, so whole pages are distinct).
"""

from __future__ import annotations

import numpy as np


class Shape:
    """The model shape: layers, total KV heads, bytes per head and token
    (head_dim x dtype bytes), tokens per page (block)."""

    def __init__(self, layers, kv_heads, head_bytes, page_size):
        self.layers = int(layers)
        self.kv_heads = int(kv_heads)
        self.head_bytes = int(head_bytes)
        self.page_size = int(page_size)

    def pages(self, tokens):
        return -(-int(tokens) // self.page_size)

    def heads_of(self, tp_rank, tp_size):
        """The global KV heads [h0, h1) of one TP rank."""
        per = self.kv_heads // tp_size
        return tp_rank * per, (tp_rank + 1) * per

    def bytes_per_page(self):
        """Bytes of one page over every layer, K and V, head."""
        return self.layers * 2 * self.kv_heads * self.page_size * self.head_bytes


def _tables(seed, shape, npages):
    rng = np.random.default_rng([0x6B76686F7374, int(seed)])
    a = rng.integers(0, 256, (shape.layers, 2, shape.kv_heads), dtype=np.uint8)
    t = rng.integers(0, 256, npages * shape.page_size, dtype=np.uint8)
    b = rng.integers(0, 256, shape.head_bytes, dtype=np.uint8)
    return a, t, b


def expected(seed, shape, npages, h0, h1):
    """The request's KV for heads [h0, h1), in a vLLM HND pool's order:
    (layers, 2, pages, heads, page_size, head_bytes), uint8."""
    a, t, b = _tables(seed, shape, npages)
    a = a[:, :, h0:h1]
    t = t.reshape(npages, shape.page_size)
    # uint8 arithmetic wraps: mod 256.
    return (
        a[:, :, None, :, None, None]
        + t[None, None, :, None, :, None]
        + b[None, None, None, None, None, :]
    )


def _in_layout(seed, shape, npages, h0, h1, layout, out):
    """expected() in the pool's own order (HND or NHD), written into out
    (a reused buffer): each head row of the request is one row of the
    table R[c] = (c + B) mod 256, picked by c = A + T, a gather of whole
    rows instead of a broadcast add over every byte."""
    a, t, b = _tables(seed, shape, npages)
    c = a[:, :, None, h0:h1, None] + t.reshape(npages, shape.page_size)[None, None, :, None, :]
    if layout == "NHD":
        c = c.transpose(0, 1, 2, 4, 3)
    elif layout != "HND":
        raise ValueError("layout %r: want HND or NHD" % layout)
    rows = np.arange(256, dtype=np.uint8)[:, None] + b[None, :]  # uint8: mod 256
    # c < 256 = len(rows): "clip" never clips, and lets take write
    # straight into out ("raise" buffers it).
    return np.take(rows, c, axis=0, out=out, mode="clip")


_BUFS = {}


def _buf(name, shape):
    """A reused buffer: a fresh multi-MiB array per request costs its page
    faults every time, more than the work done in it."""
    buf = _BUFS.get(name)
    if buf is None or buf.shape != shape:
        buf = _BUFS[name] = np.empty(shape, dtype=np.uint8)
    return buf


def _hnd(x, layout):
    """x (layers, 2, pages, ...) in HND order: a view."""
    if layout == "HND":
        return x
    if layout == "NHD":  # (.., page_size, heads, head_bytes): SGLang's MHA pages
        return x.transpose(0, 1, 2, 4, 3, 5)
    raise ValueError("layout %r: want HND or NHD" % layout)


def fill(pool, block_ids, seed, shape, h0, h1, layout="HND"):
    """Writes the request's KV for heads [h0, h1) into ``pool`` at
    block_ids. pool: (layers, 2, num_blocks, heads, page_size, head_bytes)
    (HND, vLLM's) or (layers, 2, num_blocks, page_size, heads, head_bytes)
    (NHD, SGLang's MHA pages)."""
    ids = np.asarray(block_ids, dtype=np.int64)
    dims = pool.shape[:2] + (len(ids),) + pool.shape[3:]
    pool[:, :, ids] = _in_layout(seed, shape, len(ids), h0, h1, layout, _buf("want", dims))


def check(pool, block_ids, seed, shape, h0, h1, layout="HND"):
    """None when the request's pages hold exactly its KV for heads
    [h0, h1), else a sentence naming the first wrong byte."""
    ids = np.asarray(block_ids, dtype=np.int64)
    # Every byte, compared in the pool's own order, 8 at a time when rows
    # allow; the sentence below is built only when something is wrong.
    dims = pool.shape[:2] + (len(ids),) + pool.shape[3:]
    if len(ids) and (ids.min() < 0 or ids.max() >= pool.shape[2]):
        raise IndexError("block ids out of range 0..%d" % (pool.shape[2] - 1))
    if pool.flags.c_contiguous:
        got = np.take(pool, ids, axis=2, out=_buf("got", dims), mode="clip")
    else:
        # take would first copy the whole pool contiguous (SGLang's pools
        # are a (layers, 2, ...) view of K buffers then V buffers).
        got = pool[:, :, ids]
    want = _in_layout(seed, shape, len(ids), h0, h1, layout, _buf("want", dims))
    if got.shape[-1] % 8 == 0:
        same = np.array_equal(got.view(np.uint64), want.view(np.uint64))
    else:
        same = np.array_equal(got, want)
    if same:
        return None
    got = _hnd(pool[:, :, ids], layout)
    want = expected(seed, shape, len(ids), h0, h1)
    bad = got != want
    if not bad.any():
        return None
    n = int(np.count_nonzero(bad))
    layer, kv, page, head, tok, byte = (int(x) for x in np.argwhere(bad)[0])
    return (
        "page %d (block %d) layer %d %s head %d token %d byte %d: got 0x%02x, want 0x%02x (%d wrong bytes)"
        % (
            page,
            int(ids[page]),
            layer,
            "KV"[kv],
            h0 + head,
            page * shape.page_size + tok,
            byte,
            int(got[layer, kv, page, head, tok, byte]),
            int(want[layer, kv, page, head, tok, byte]),
            n,
        )
    )


def aux_bytes(seed, n):
    """The request's aux (SGLang's metadata buffer slot) contents."""
    rng = np.random.default_rng([0x617578, int(seed)])
    return rng.integers(0, 256, n, dtype=np.uint8)
