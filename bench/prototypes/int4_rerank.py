"""Research prototype (issue 35, not a rule of the library): the box estimate's candidates re-ranked by 4-bit keys.

Twilight's two stages (Lin et al., arXiv 2502.02770) on tinyattn's pages, as phase 1 measured on niah_single_1
(branch ``select``, ``docs/design_selection.md`` there): stage 1 keeps the ``C = ceil(candidates * page_budget)``
best pages of the box estimate (``tinyattn.page_scores(..., gamma)``, the recipe's default estimate); stage 2
scores every token of the candidates with its key quantised to ``bits`` bits per channel *inside its page's box*
(``k~ = k_min + round((k - k_min) / d) * d``, ``d = (k_max - k_min) / (2^bits - 1)``: the boxes the cache keeps are
the quantisation range, so a stored copy would need no scales), and ranks each candidate page by its estimated
attention mass ``log sum_{g, t in page} softmax_g(scale * q_g . k~_t)`` (per query head over all candidate tokens,
summed over the GQA group). The pages are then chosen by the library's own :func:`tinyattn.select_pages` (forced
pages, fixed budget or ``top_p`` over that mass with ``scale=1``): no copy of the selection or top-p rule here.

Torch only, evaluation-only cost: the candidates' keys are gathered from the full-precision pool and quantised on
the fly (a library form would keep the 4-bit codes beside the pool). Decode steps only (``Tq = 1``).

Run any bench script that takes policy labels with the prototype registered as ``int4rerank``::

    python bench/prototypes/int4_rerank.py bench/smollm2_ruler.py --out /tmp/proto --tasks niah_single_2 \\
        --policies int4rerank:top_p=0.8 --budgets 1/4 --stock none
"""

from __future__ import annotations

import math
import runpy
import sys
from pathlib import Path

import torch

import tinyattn
from tinyattn import selection as _sel
from tinyattn.ops.attention.torch_impl import page_rows

NEG_INF = float("-inf")


def box_quantize(keys: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, bits: int) -> torch.Tensor:
    """Keys ``[..., S, D]`` quantised to ``bits`` bits per channel inside their page's box ``[..., D]``, dequantised
    (a channel of zero width is exact)."""
    levels = (1 << bits) - 1
    step = (kmax - kmin) / levels
    safe = torch.where(step > 0, step, 1.0)[..., None, :]
    code = ((keys - kmin[..., None, :]) / safe).round().clamp(0, levels)
    return kmin[..., None, :] + code * torch.where(step > 0, step, 0.0)[..., None, :]


def candidate_keys(ctx, cand: torch.Tensor):
    """fp32 keys ``[B, Hkv, C, S, D]``, the decode query's visible-key mask ``[B, Hkv, C, S]`` and boxes
    ``[B, Hkv, C, D]`` of the candidate logical pages ``cand`` (``-1`` padded), through the torch attention's own
    gather (:func:`tinyattn.ops.attention.torch_impl.page_rows`: hidden slots read a filler key, masked)."""
    S, Hkv, D = ctx.page_size, ctx.num_kv_heads, ctx.k_cache.shape[-1]
    rows, _, visible = page_rows(ctx.block_table, ctx.seq_lens, cand, page_size=S, num_kv_heads=Hkv)
    keys = ctx.k_cache.reshape(-1, D)[rows].float()
    box = rows[..., 0] // (S * Hkv) * Hkv + torch.arange(Hkv, device=rows.device)[None, :, None]   # phys * Hkv + h
    return keys, visible[:, :, 0], ctx.k_min.reshape(-1, D)[box].float(), ctx.k_max.reshape(-1, D)[box].float()


class Int4Rerank(_sel.SelectionPolicy):
    """Box estimate (``gamma``) -> ``candidates`` x the budget -> ``bits``-bit mass re-rank -> fixed or top-p."""

    name = "int4rerank"

    def __init__(self, bits: int = 4, candidates: float = 1.0, gamma: float = 0.25, top_p: float | None = None):
        self.bits, self.candidates, self.gamma, self.top_p = int(bits), float(candidates), float(gamma), top_p

    def __repr__(self):
        return (f"Int4Rerank(bits={self.bits}, candidates={self.candidates}, gamma={self.gamma}, "
                f"top_p={self.top_p})")

    def select(self, ctx):
        q4 = ctx.q4
        B, Tq, Hq, D = q4.shape
        if Tq != 1:
            raise NotImplementedError("the prototype scores decode steps (Tq = 1) only")
        scale = D ** -0.5 if ctx.scale is None else ctx.scale
        rules = dict(page_size=ctx.page_size, num_sink_pages=ctx.num_sink_pages,
                     num_recent_pages=ctx.num_recent_pages, num_query_tokens=Tq, backend=ctx.backend)
        est = tinyattn.page_scores(ctx.q, ctx.k_min, ctx.k_max, ctx.block_table, ctx.seq_lens,
                                   page_size=ctx.page_size, gamma=self.gamma, backend=ctx.backend)
        C = max(math.ceil(self.candidates * ctx.page_budget), ctx.page_budget)
        cand = tinyattn.select_pages(est, ctx.seq_lens, page_budget=C, **rules)             # [B, Hkv, C]
        keys, mask, kmin, kmax = candidate_keys(ctx, cand)
        keys = box_quantize(keys, kmin, kmax, self.bits)
        qg = q4[:, 0].float().view(B, ctx.num_kv_heads, Hq // ctx.num_kv_heads, D)       # [B, Hkv, G, D]
        logits = torch.einsum("bhgd,bhcsd->bhgcs", qg, keys) * scale
        logits = logits.masked_fill(~mask[:, :, None], NEG_INF)
        per_head = logits - logits.flatten(-2).logsumexp(-1)[..., None, None]             # log softmax per head
        mass = per_head.nan_to_num(nan=NEG_INF).logsumexp((2, 4))                          # [B, Hkv, C]
        scores = torch.full((B, ctx.num_kv_heads, ctx.max_pages + 1), NEG_INF, device=q4.device)
        scores.scatter_(-1, torch.where(cand >= 0, cand.long(), ctx.max_pages), torch.where(cand >= 0, mass, NEG_INF))
        return tinyattn.select_pages(scores[..., :-1].contiguous(), ctx.seq_lens, page_budget=ctx.page_budget,
                                     top_p=self.top_p, scale=1.0 if self.top_p is not None else None, **rules)


def register() -> None:
    """Add the prototype to :data:`tinyattn.selection.POLICIES` as ``int4rerank``."""
    _sel.POLICIES[Int4Rerank.name] = Int4Rerank


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
        print(__doc__)
        raise SystemExit(0)
    register()
    script = Path(sys.argv[1]).resolve()
    sys.path.insert(0, str(script.parent))
    sys.argv = sys.argv[1:]
    runpy.run_path(str(script), run_name="__main__")
