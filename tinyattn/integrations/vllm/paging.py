"""What the vLLM backend does to tensors, without importing vLLM (unit-tested in the main suite).

vLLM hands each attention layer one cache tensor, a logical ``[num_blocks, Hkv, block_size, 2 * D]`` view
(its ``[B, H, N, C]`` with ``C`` = K and V contents) whose blocks each occupy one contiguous run of
``2 * block_size * Hkv * D`` elements (a block-compact layout without padding; vLLM zeroes a new block
through that view). The backend reinterprets the bytes of block ``b`` as two tinyattn pages::

    pool  : [2 * num_blocks, block_size, Hkv, D]   page 2b = keys of block b, page 2b + 1 = its values
    k_cache = pool[:-1]     v_cache = pool[1:]     contiguous views of 2 * num_blocks - 1 pages, no copy
    block_table (tinyattn) = 2 * block_table (vLLM)

so that page ``2b`` of ``k_cache`` holds block ``b``'s keys and page ``2b`` of ``v_cache`` its values: the
tinyattn ops read vLLM's memory directly in their own NHD layout (docs/layout.md), every page stays inside
its vLLM block (zeroing, prefix caching and preemption see ordinary blocks), and the block table is the
only thing translated. The page boxes follow the same trick in a small tensor of their own
(``[2 * num_blocks + 2, Hkv, D]``: row ``2b`` = ``k_min`` of block ``b``, row ``2b + 1`` = its ``k_max``, the last
two rows a spare block for padding tokens; ``k_min = boxes[:2 * num_blocks - 1]``, ``k_max = boxes[1:2 * num_blocks]``:
every pool and box view has the same number of pages).

:func:`write_kv` stores a step's keys and values at vLLM's ``slot_mapping`` and maintains the boxes
incrementally, like :meth:`tinyattn.cache.PagedKVCache.write`: a block whose slot 0 is written in this
step starts from an empty box (vLLM reuses freed blocks, and a block is always filled from slot 0), every
other touched block's box grows with ``amin`` / ``amax``. It makes no host sync and no value-dependent shape
(padding slots are redirected, not dropped), so that it can run inside a CUDA graph, as does
:func:`attend_groups`; everything that reads a value on the host happens once per step, in the builder.

:func:`plan_groups` splits a step's requests by query length (vLLM's mixed prefill/decode batches): all
decode rows (1 query token) form one group planned as a decode step (sparse in sparse layers), every other
query length one dense, causal group with ``Tq`` equal to that length, and a *fresh* prefill (rows with no cached
context) a group of its own: its plan attends with causal SDPA rather than under a ``[Tq x seq_len]`` mask. A uniform
single-token decode batch that vLLM padded for a CUDA graph (:func:`uniform_decode_rows`) is one decode group of
all its rows, the padding rows (``seq_len`` 0, output 0) included, so that the plan covers what the graph replays.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...ops.kv_cache import torch_impl as kv_cache

__all__ = ["block_pools", "make_boxes", "box_views", "make_codes", "code_views", "write_kv", "Group", "uniform_decode_rows", "plan_groups",
           "attend_groups"]


def _block_is_one_run(kv_cache: torch.Tensor) -> bool:
    """Whether the inner dims of ``kv_cache`` (all but dim 0) cover one dense run of memory."""
    dims = sorted((kv_cache.stride(i), kv_cache.shape[i]) for i in range(1, kv_cache.dim()) if kv_cache.shape[i] > 1)
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return False
        expected = stride * size
    return True


def block_pools(kv_cache: torch.Tensor, num_kv_heads: int, head_dim: int, block_size: int):
    """``(k_cache, v_cache)``: tinyattn pools ``[2 * num_blocks - 1, block_size, Hkv, D]`` over vLLM's cache.

    ``kv_cache``: vLLM's per-layer view ``[num_blocks, Hkv, block_size, 2 * D]`` (any block-compact
    stride order). Raises ``ValueError`` when a block is not one unpadded run of memory.
    """
    num_blocks = kv_cache.shape[0]
    page = block_size * num_kv_heads * head_dim
    if kv_cache.numel() != num_blocks * 2 * page:
        raise ValueError(f"kv_cache: expected {2 * page} elements per block (2 x block_size {block_size} x Hkv "
                         f"{num_kv_heads} x D {head_dim}), got shape {tuple(kv_cache.shape)}")
    if num_blocks > 1 and kv_cache.stride(0) != 2 * page or not _block_is_one_run(kv_cache):
        raise ValueError(f"kv_cache: expected blocks stored as one dense, unpadded run each (block stride "
                         f"{2 * page}), got strides {tuple(kv_cache.stride())}; use a block-compact "
                         f"VLLM_KV_CACHE_LAYOUT such as LBHNC")
    pool = torch.as_strided(kv_cache, (2 * num_blocks, block_size, num_kv_heads, head_dim),
                            (page, num_kv_heads * head_dim, head_dim, 1), kv_cache.storage_offset())
    return pool[:-1], pool[1:]


def make_boxes(num_blocks: int, num_kv_heads: int, head_dim: int, *, dtype, device) -> torch.Tensor:
    """Empty page boxes of ``num_blocks`` blocks: ``[2 * num_blocks + 2, Hkv, D]`` (+inf mins, -inf maxes).

    Rows ``2b`` / ``2b + 1`` are block ``b``'s ``k_min`` / ``k_max``; the last two rows are a spare block that
    :func:`write_kv` sends its padding tokens to (no host sync to drop them) and that :func:`box_views` leaves out.
    """
    boxes = torch.empty(num_blocks + 1, 2, num_kv_heads, head_dim, dtype=dtype, device=device)
    boxes[:, 0] = float("inf")
    boxes[:, 1] = float("-inf")
    return boxes.view(2 * (num_blocks + 1), num_kv_heads, head_dim)


def box_views(boxes: torch.Tensor):
    """``(k_min, k_max)`` as the ops take them, indexed by tinyattn page id ``2b`` (see the module doc):
    ``2 * num_blocks - 1`` pages each, like the pools of :func:`block_pools`."""
    pages = boxes.shape[0] - 3
    return boxes[:pages], boxes[1: pages + 1]


def make_codes(num_blocks: int, num_kv_heads: int, head_dim: int, block_size: int, *, device) -> torch.Tensor:
    """4-bit key codes of ``num_blocks`` blocks (``rerank="int4"``): ``[num_blocks + 1, block_size, Hkv, D/2]``
    uint8, the last block a spare that :func:`write_kv`'s padding tokens may encode into (never read)."""
    return torch.zeros(num_blocks + 1, block_size, num_kv_heads, head_dim // 2, dtype=torch.uint8, device=device)


def code_views(codes: torch.Tensor) -> torch.Tensor:
    """``k_code`` as the ops take it, indexed by tinyattn page id ``2b`` like :func:`box_views`: a strided view
    ``[2 * num_blocks - 1, block_size, Hkv, D/2]`` whose page ``2b`` is block ``b``'s codes (a page stride of half
    a block: the odd pages, the value pages, overlap and are never read as keys). No copy."""
    blocks, size, heads, half = codes.shape
    page = size * heads * half
    pages = 2 * (blocks - 1) - 1
    return torch.as_strided(codes, (pages, size, heads, half), (page // 2, heads * half, half, 1),
                            codes.storage_offset())


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, boxes: torch.Tensor | None, key: torch.Tensor,
             value: torch.Tensor, slot_mapping: torch.Tensor, block_size: int, codes: torch.Tensor | None = None) -> None:
    """Store ``key``, ``value`` ``[N, Hkv, D]`` at vLLM slots ``slot_mapping`` ``[N]`` (``block * block_size +
    offset``; negative = padding, skipped) and maintain the boxes of the touched blocks.

    ``k_cache`` / ``v_cache``: from :func:`block_pools`; ``boxes``: from :func:`make_boxes` (or ``None``: dense
    mode keeps no boxes). No host sync and no value-dependent shape (CUDA-graph safe): a padding token is
    written to the row of the step's first real token with that token's key and value (duplicate indices with
    equal values), or, in a step of padding only, writes back what that row holds; in the boxes it targets the
    spare block of :func:`make_boxes` with neutral values. Memory outside the real slots is left bit-identical.
    ``codes``: from :func:`make_codes` (``rerank="int4"``), or ``None``: the blocks this step fills (its slot
    ``block_size - 1`` written) get their 4-bit key codes inside their grown boxes
    (:func:`tinyattn.ops.kv_cache.torch_impl.encode_key_codes`: a host sync, as the CPU build has).
    """
    n = min(slot_mapping.shape[0], key.shape[0])
    if n == 0:
        return
    slots, key, value = slot_mapping[:n].to(torch.int64), key[:n], value[:n]
    real = slots >= 0
    slots = slots.clamp_min(0)
    blocks = torch.div(slots, block_size, rounding_mode="floor")
    offsets = slots - blocks * block_size
    rows = 2 * blocks * block_size + offsets                      # tinyattn slots: page 2b holds block b
    Hkv, D = k_cache.shape[-2], k_cache.shape[-1]
    # a padding token rewrites the step's first real token (same row, same key and value), or, in a step of padding
    # only, what its row already holds: no host sync to drop them, memory outside the real slots bit-identical.
    # The first real token by index ([1], on device), never a 0-dim index, which Python reads on the host
    first = real.to(torch.int32).argmax().view(1)
    row, first_real = rows[first], real[first][:, None, None]
    mask = real[:, None, None]
    key = torch.where(mask, key, torch.where(first_real, key[first], k_cache.view(-1, Hkv, D)[row].to(key.dtype)))
    value = torch.where(mask, value,
                        torch.where(first_real, value[first], v_cache.view(-1, Hkv, D)[row].to(value.dtype)))
    rows = torch.where(real, rows, row)
    if boxes is None:
        kv_cache.write_kv(key, value, rows, k_cache, v_cache, None, None, None, None, None)
        return
    # the boxes by vLLM block (row b of k_min / k_max: block b's; row num_blocks: the spare block padding tokens
    # target, never read). vLLM reuses freed blocks without telling the backend; a block is filled from slot 0, so a
    # block written from slot 0 is new (or reused): its box restarts empty before growing
    k_min, k_max = boxes[0::2], boxes[1::2]
    spare = k_min.shape[0] - 1
    box_pages = torch.where(real, blocks, spare)
    kv_cache.reset_boxes(k_min, k_max, torch.where(real & (offsets == 0), blocks, spare))
    kv_cache.write_kv(key, value, rows, k_cache, v_cache, k_min, k_max, None, None, None, box_pages)
    if codes is not None:     # pages filled by this step (a padding token rewrites a real row: the same codes)
        lo, hi = box_views(boxes)
        kv_cache.encode_key_codes(k_cache, rows, lo, hi, code_views(codes))


@dataclass
class Group:
    """Rows of one step with the same query length ``Tq``: ``tokens`` is a ``slice`` of the step's tokens when
    they are contiguous (decodes first, as vLLM orders them), else an index tensor; ``attn`` is the planned
    :class:`tinyattn.layer.PagedAttention`."""

    num_query_tokens: int
    num_rows: int
    tokens: object
    attn: object


def uniform_decode_rows(query_start_loc_cpu: torch.Tensor, num_tokens: int) -> int | None:
    """``R`` when a step is a uniform single-token decode batch as vLLM pads it for a CUDA graph, else ``None``.

    Such a step has ``R`` rows and ``num_tokens == R`` tokens: rows with one query token, then padding rows with
    none (their ``query_start_loc`` repeats, their ``seq_lens`` are 0, their block-table rows vLLM's null block,
    their padding tokens' slots -1). ``query_start_loc_cpu``: ``[R + 1]`` host tensor.
    """
    starts = query_start_loc_cpu.tolist()
    rows = len(starts) - 1
    if rows < 1 or num_tokens != rows:
        return None
    lens = [b - a for a, b in zip(starts[:-1], starts[1:])]
    real = sum(lens)
    if lens != [1] * real + [0] * (rows - real):
        return None
    return rows


def plan_groups(query_start_loc_cpu: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor, *,
                make_attention, num_q_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
                scale: float, seq_lens_cpu: torch.Tensor | None = None, tables=None,
                decode_rows: int | None = None) -> list[Group]:
    """Group a step's rows by query length and plan each group once (all layers of the step share it).

    Decode rows (``Tq == 1``) form one group planned as a decode step. Prefill rows with cached context
    (chunked prefill, prefix-cache hits) form one dense group per query length through the paged op with
    ``Tq > 1``; prefill rows without cached context (``seq_len == Tq``) one *fresh* group per length (its plan
    attends with causal SDPA).

    Args:
        query_start_loc_cpu: ``[R + 1]`` host tensor, row ``r``'s tokens are ``[q[r], q[r+1])``.
        block_table: ``[R, max_blocks]`` vLLM block ids (device); seq_lens: ``[R]`` tokens incl. the queries.
        make_attention: ``(Tq, fresh) -> PagedAttention`` (the builder keeps one per key to reuse its buffers).
        seq_lens_cpu: ``seq_lens`` on the host, exact for prefill rows (default: ``seq_lens``, copied).
        tables: a :class:`tinyattn.integrations.vllm.step_tables.StepTables`: the translated tables are copied
            into its persistent buffers and the plans made on views of them (default: new tensors).
        decode_rows: ``R`` from :func:`uniform_decode_rows` (a CUDA-graph batch): one decode group of all ``R``
            rows and tokens, padding rows included (``seq_len`` 0: their output is 0), whatever the lengths.
    """
    if tables is not None:
        all_bt, all_sl = tables.load(block_table, seq_lens)
    else:
        all_bt, all_sl = block_table * 2, seq_lens
    if decode_rows is not None:
        if decode_rows != block_table.shape[0]:
            raise ValueError(f"decode_rows: expected the step's {block_table.shape[0]} rows, got {decode_rows}")
        attn = make_attention(1, False)
        attn.begin(all_bt, all_sl, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                   page_size=page_size, num_query_tokens=1, decode=True, scale=scale, trusted=True,
                   max_batch=decode_rows, max_pages_per_seq=all_bt.shape[1])    # graph mode: fixed storage
        return [Group(1, decode_rows, slice(0, decode_rows), attn)]
    starts = query_start_loc_cpu.tolist()
    lens = (seq_lens if seq_lens_cpu is None else seq_lens_cpu).tolist()
    by_key: dict[tuple[int, bool], list[int]] = {}
    for row, (a, b) in enumerate(zip(starts[:-1], starts[1:])):
        if b > a:
            tq = b - a
            by_key.setdefault((tq, tq > 1 and lens[row] == tq), []).append(row)
    device = block_table.device
    groups = []
    for tq, fresh in sorted(by_key):
        rows = by_key[(tq, fresh)]
        first, last = rows[0], rows[-1]
        if last - first + 1 == len(rows):                 # consecutive rows: consecutive tokens
            tokens = slice(starts[first], starts[last + 1])
            idx = slice(first, last + 1)
        else:
            tok = (torch.tensor([starts[r] for r in rows], dtype=torch.int64)[:, None] + torch.arange(tq)).reshape(-1)
            tokens = tok.to(device)
            idx = torch.tensor(rows, dtype=torch.int64, device=device)
        bt, sl = all_bt[idx], all_sl[idx]
        attn = make_attention(tq, fresh)
        attn.begin(bt, sl, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                   page_size=page_size, num_query_tokens=tq, decode=tq == 1, scale=scale, trusted=True)
        groups.append(Group(tq, len(rows), tokens, attn))
    return groups


def attend_groups(groups: list[Group], layer: int, query: torch.Tensor, output: torch.Tensor, k_cache, v_cache, k_min,
                  k_max, scale: float, window_left: int = -1, k_code: torch.Tensor | None = None) -> torch.Tensor:
    """One layer of a step: each group's plan on ``query`` ``[num_tokens, Hq, D]``, into ``output`` (same shape).

    The step's keys and values are already written to the cache; a fresh prefill group's plan attends over them
    with causal SDPA (:class:`tinyattn.ops.plan_torch.TorchPlan`'s prefill route; the Triton kernel on a GPU).
    ``k_min`` / ``k_max``: :func:`box_views` of the layer's boxes, or ``None``. ``window_left``: the layer's
    sliding window (a query at position ``p`` sees keys ``[p - window_left, p]``; ``-1`` = none). A sliding layer
    attends densely over its window in every group and never selects, so it reads no page wholly before the
    window: vLLM's sliding-window KV manager frees those blocks and reuses them while the step's block table still
    lists them (stale ids). ``k_code``: :func:`code_views` of the layer's 4-bit key codes (``rerank="int4"``).
    """
    Hq, D = query.shape[-2], query.shape[-1]
    for g in groups:
        tq = g.num_query_tokens
        q = query[g.tokens]
        q = q.view(g.num_rows, Hq, D) if tq == 1 else q.view(g.num_rows, tq, Hq, D)
        out = g.attn(layer, q, k_cache, v_cache, k_min, k_max, scale=scale, window_left=window_left, k_code=k_code)
        output[g.tokens] = out.reshape(-1, Hq, D)
    return output
