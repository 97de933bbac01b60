"""Research prototype (issue 35's cost bar, not a rule of the library): how fast could the 4-bit re-rank be on a CPU?

``bench/rerank_cost.py`` measures the library's torch form of :func:`tinyattn.rerank_scores` at +55-58% of a 32K
sparse step (bar: 10%). This script asks what a *fused* CPU form would reach, to tell "our code is slow" from "the
bar is out of reach of the CPU forms the project allows" (torch ops, ``torch.compile``; no hand-written C). Same
problem as ``rerank_cost.py`` (its ``build_cache``: batch 1, 32 / 8 heads of 128, fp32, page 16, 32K tokens, 128
candidate pages = the 2048-token capacity), one torch thread, interleaved rounds, medians in ms:

- ``A``: the sparse step the bar is measured against (``plan(page_budget=128, num_sink_pages=1, gamma=0.25)``, ``run``);
- ``library``: ``tinyattn.rerank_scores(..., backend="torch")`` on the same 128 candidates;
- ``library decode+matmul``: its two heavy stages alone (the codes decoded to fp32 keys, one matmul per KV head);
- ``fused``: the prototype below under ``torch.compile`` (inductor's generated C++): codes gathered as bytes, the
  per-page step folded into the queries (``q·k = q·lo + Σ_i (q_i·step_i)·c_i``) and the dot product reduced straight
  from the nibbles (never a ``[C, S, D]`` fp32 key tensor), then the same mask / logsumexp / mass as the library;
- ``fused gather``: its eager part alone (the code rows and the candidates' boxes gathered by ``index_select``).

The prototype covers only this problem's case (one row, one decode query, no window). It is a second formulation
of the re-rank rule: it stays here, outside the package (one copy of each
rule per backend); the script checks it against the library's torch form before timing. The first call compiles
(about 10 s).

    nice -n 5 .venv/bin/python bench/prototypes/rerank_floor.py --repeats 100
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import rerank_cost as R  # noqa: E402

import tinyattn  # noqa: E402
from tinyattn.ops.layout import NEG_INF, group_queries  # noqa: E402
from tinyattn.ops.selection import torch_impl as selection_torch  # noqa: E402


def gather(k_code, k_min, k_max, phys, heads, page_size):
    """Eager: the candidates' code rows ``[B, Hkv, C, S, D/2]`` uint8 and their boxes ``(lo, step)`` ``[B, Hkv, C, D]``."""
    half, num_kv_heads = k_code.shape[-1], k_code.shape[2]
    rows = (phys[..., None] * page_size + torch.arange(page_size)) * num_kv_heads + heads[..., None]
    codes = k_code.reshape(-1, half).index_select(0, rows.flatten()).view(*rows.shape, half)
    rows = phys * num_kv_heads + heads
    lo = k_min.reshape(-1, k_min.shape[-1]).index_select(0, rows.flatten()).view(*rows.shape, -1).float()
    hi = k_max.reshape(-1, k_max.shape[-1]).index_select(0, rows.flatten()).view(*rows.shape, -1).float()
    step = (hi - lo) / 15.0
    return codes, lo, torch.where(step > 0, step, 0.0)


def fused_mass(qg, codes, lo, step, exact_logits, is_last, seen, scale):
    """log attention mass per candidate ``[B, Hkv, C]`` from nibbles, without decoded keys (compiled below)."""
    half = codes.shape[-1]
    c = codes.to(torch.int32)
    low, high = (c & 15).float()[:, :, :, None], (c >> 4).float()[:, :, :, None]          # [B, Hkv, C, 1, S, D/2]
    qs = (qg[:, :, None] * step[:, :, :, None, :])[..., None, :]                           # [B, Hkv, C, M, 1, D]
    logits = (qs[..., :half] * low).sum(-1) + (qs[..., half:] * high).sum(-1)              # [B, Hkv, C, M, S]
    logits = logits + (qg[:, :, None] * lo[:, :, :, None, :]).sum(-1)[..., None]
    logits = torch.where(is_last[..., None, None], exact_logits[:, :, None], logits) * scale
    logits = logits.masked_fill(~seen, NEG_INF)
    z = logits.logsumexp(dim=(2, 4), keepdim=True)                                        # [B, Hkv, 1, M, 1]
    z = torch.where(z == NEG_INF, 0.0, z)
    return (logits - z).exp().sum(dim=(3, 4)).log()


def problem(context: int, budget: int, seed: int) -> SimpleNamespace:
    """rerank_cost.py's cache and query (batch 1, one decode query), the plan of the sparse step ``A``, the box
    estimate's ``budget`` best pages as the candidates, and what the prototype reads of them."""
    S, Hkv = R.PAGE_SIZE, R.NUM_KV_HEADS
    cache, sid = R.build_cache(context, seed=seed, outlier_channels=4, outlier_scale=8.0)
    p = SimpleNamespace(bt=cache.block_table([sid]), sl=cache.seq_lens([sid]), kc=cache.k_cache[0],
                        vc=cache.v_cache[0], k_min=cache.k_min[0], k_max=cache.k_max[0], k_code=cache.k_code[0],
                        q=torch.randn(1, R.NUM_Q_HEADS, R.HEAD_DIM, generator=torch.Generator().manual_seed(seed + 1)))
    p.plan = tinyattn.PagedAttentionPlan(backend="torch").plan(
        p.bt, p.sl, num_q_heads=R.NUM_Q_HEADS, num_kv_heads=Hkv, head_dim=R.HEAD_DIM, page_size=S,
        page_budget=budget, num_sink_pages=1, gamma=0.25)
    with tinyattn.value_checks(False):
        scores = tinyattn.page_scores(p.q, p.k_min, p.k_max, p.bt, p.sl, page_size=S, gamma=0.25, backend="torch")
        p.cand = tinyattn.select_pages(scores, p.sl, page_size=S, page_budget=budget, num_sink_pages=1,
                                       backend="torch")
    # the candidates' tables, made once (as the library does per call: cheap [B, Hkv, C] ops)
    p.n = -(-int(p.sl[0]) // S)
    p.j = p.cand.to(torch.int64)
    p.phys = p.bt.to(torch.int64)[0][p.j]
    p.heads = torch.arange(Hkv)[None, :, None]
    p.qg = group_queries(p.q[:, None], Hkv, torch.float32)
    last = p.kc[int(p.bt[0, p.n - 1])]                                                # [S, Hkv, D]
    p.exact_logits = torch.einsum("bhmd,shd->bhms", p.qg, last)
    key_pos = p.j[..., None, None] * S + torch.arange(S)                               # [B, Hkv, C, 1, S]
    p.seen = (key_pos < int(p.sl[0])).expand(-1, -1, -1, p.qg.shape[2], -1)
    return p


def library_mass(p) -> torch.Tensor:
    """The library's torch form, ``[B, Hkv, max_pages]``."""
    with tinyattn.value_checks(False):
        return tinyattn.rerank_scores(p.q, p.k_code, p.kc, p.k_min, p.k_max, p.cand, p.bt, p.sl, backend="torch")


def prototype_mass(p, mass_fn=fused_mass) -> torch.Tensor:
    """The prototype (``mass_fn``: :func:`fused_mass`, compiled or not), ``[B, Hkv, C]`` in the candidates' order."""
    codes, lo, step = gather(p.k_code, p.k_min, p.k_max, p.phys, p.heads, R.PAGE_SIZE)
    return mass_fn(p.qg, codes, lo, step, p.exact_logits, p.j == p.n - 1, p.seen, R.HEAD_DIM ** -0.5)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--context", type=int, default=32768, help="tokens in the sequence (default: 32768)")
    p.add_argument("--budget", type=int, default=128, help="capacity = candidates, pages of 16 (default: 128)")
    p.add_argument("--repeats", type=int, default=100, help="interleaved rounds (default: 100)")
    p.add_argument("--seed", type=int, default=0, help="seed of the data and of the call order (default: 0)")
    p.add_argument("--out", type=Path, default=None,
                   help="also write the table to OUT/rerank_floor.md (the committed run: docs/bench/rerank_cost)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    pb = problem(args.context, args.budget, args.seed)
    compiled = torch.compile(fused_mass, dynamic=False)

    def library_decode_matmul():
        keys = selection_torch.decode_key_codes(pb.k_code, pb.k_min, pb.k_max, pb.phys, pb.heads)
        return torch.matmul(pb.qg, keys.view(1, R.NUM_KV_HEADS, -1, R.HEAD_DIM).transpose(-1, -2))

    want = library_mass(pb)[0].gather(-1, pb.j[0])                                    # [Hkv, C]
    got = prototype_mass(pb, compiled)[0]
    err = float((got - want).abs().max())
    print(f"fused vs library: max |log-mass difference| {err:.2e}")
    if not err < 1e-3:
        raise SystemExit("the prototype does not compute the library's rule")
    methods = {"A": lambda: pb.plan.run(pb.q, pb.kc, pb.vc, k_min=pb.k_min, k_max=pb.k_max),
               "library": lambda: library_mass(pb), "library decode+matmul": library_decode_matmul,
               "fused": lambda: prototype_mass(pb, compiled),
               "fused gather": lambda: gather(pb.k_code, pb.k_min, pb.k_max, pb.phys, pb.heads, R.PAGE_SIZE)}
    samples = R.time_interleaved(methods, repeats=args.repeats, warmup=3, seed=args.seed, progress=True)
    a = statistics.median(samples["A"]) / 1e3
    lines = ["# The re-rank's CPU floor: the library's torch form beside a fused, compiled prototype", "",
             f"Machine: {R.C.machine_name('cpu')}; nice {os.nice(0)}, load average "
             f"{os.getloadavg()[0]:.2f} after the run. Context {args.context}, {args.budget} candidate pages, "
             f"{args.repeats} interleaved rounds; fused vs library: max |log-mass difference| {err:.1e}.", "",
             f"Command: `nice -n 5 .venv/bin/python bench/prototypes/rerank_floor.py {' '.join(sys.argv[1:])}`", "",
             "| method | median ms | / A |", "|---|---:|---:|"]
    for name, s in samples.items():
        med = statistics.median(s) / 1e3
        lines.append(f"| {name} | {med:.2f} | {med / a:.1%} |")
    print("\n" + "\n".join(lines))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "rerank_floor.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
