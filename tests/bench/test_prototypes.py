"""bench/prototypes/int4_rerank.py, the research prototype of issue 35's second stage: its re-rank agrees with the
oracle where it is exact, and its top-p goes through the library's rule (p = 1 keeps the fixed budget's pages).
bench/prototypes/rerank_floor.py, the fused form timed against the library's: it computes the library's masses."""


import pytest
import torch

from paths import load_bench
from paged_problems import make_problem
from tinyattn import selection as S


def _prototype():
    return load_bench("prototypes/int4_rerank")


def _ctx(seed, budget=5):
    p = make_problem(seed, batch=2, seq_lens=[77, 130], page_size=8, num_kv_heads=2, group=3, head_dim=16)
    k_min, k_max = p.bounds()
    return S.SelectionContext(layer=0, q=p.q, k_cache=p.k_cache, v_cache=p.v_cache, k_min=k_min, k_max=k_max,
                              block_table=p.block_table, seq_lens=p.seq_lens, page_budget=budget, num_sink_pages=1,
                              num_recent_pages=1)


@pytest.mark.parametrize("seed", range(6))
def test_exact_rerank_over_every_page_is_the_oracle(seed):
    """With keys at 16 bits (exact to fp32 rounding at these sizes) and every page a candidate, the estimated mass is
    the true attention mass: the pages are the oracle policy's (an independent route: page_attention_mass)."""
    P = _prototype()
    ctx = _ctx(seed)
    assert torch.equal(P.Int4Rerank(bits=16, candidates=100.0).select(ctx), S.get_policy("oracle").select(ctx))


@pytest.mark.parametrize("seed", range(4))
def test_top_p_through_the_library(seed):
    P = _prototype()
    ctx = _ctx(seed)
    fixed = P.Int4Rerank().select(ctx)
    assert torch.equal(P.Int4Rerank(top_p=1.0).select(ctx), fixed)
    small = P.Int4Rerank(top_p=0.3).select(ctx)
    assert ((small >= 0).sum(-1) <= (fixed >= 0).sum(-1)).all()
    assert ((small >= 0).sum(-1) >= 1).all()                  # the recent page is always kept


def test_box_quantize_stays_in_the_box_and_is_exact_on_flat_channels():
    P = _prototype()
    keys = torch.randn(3, 8, 5)
    kmin, kmax = keys.amin(-2), keys.amax(-2)
    kmin[:, 0] = kmax[:, 0] = keys[:, 0, 0] = 0.0
    keys[:, :, 0] = 0.0
    q = P.box_quantize(keys, kmin, kmax, 4)
    assert (q >= kmin[:, None] - 1e-6).all() and (q <= kmax[:, None] + 1e-6).all()
    assert ((q - keys).abs() <= (kmax - kmin)[:, None] / 30 + 1e-6).all()       # half a step of 15 levels
    assert torch.equal(q[:, :, 0], keys[:, :, 0])


def test_the_fused_floor_prototype_computes_the_librarys_rerank():
    """The fused formulation (step folded into the queries, dot product from the nibbles), run eagerly, gives the
    log-masses of ``tinyattn.rerank_scores``'s torch form on the same candidates, the row's last page (read exactly)
    among them: the floor it times is the library's rule."""
    F = load_bench("prototypes/rerank_floor")
    p = F.problem(context=1000, budget=8, seed=3)                 # 63 pages, the last one partial
    want = F.library_mass(p)[0].gather(-1, p.j[0])
    got = F.prototype_mass(p)[0]
    assert bool((p.j == p.n - 1).any())
    assert torch.isfinite(want).all()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
