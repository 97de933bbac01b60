"""Page-selection policies (tinyattn.selection) against independent brute-force computations.

The brute-force twins below loop over rows, KV heads, query heads and tokens in plain Python/fp64 and
rank pages with sorted(); they share no code with the policies.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tinyattn
from tinyattn import selection as S
from paged_problems import make_problem, problems

TORCH = "torch"
POLICY_NAMES = ["quest", "questmass", "meanstd", "oracle", "streaming", "h2o", "random"]


def problem(seed=0, lens=(37, 5, 64, 0, 16), page_size=4, Hkv=2, G=2, D=8, Tq=1):
    return make_problem(seed, batch=len(lens), seq_lens=list(lens), page_size=page_size, num_kv_heads=Hkv,
                        group=G, head_dim=D, num_query_tokens=Tq, logit_scale=1.5)


def context(pb, budget, *, layer=0, sinks=0, recent=1, q=None):
    k_min, k_max = pb.bounds()
    q = pb.q if q is None else q
    return S.SelectionContext(layer=layer, q=q[:, 0] if q.shape[1] == 1 else q, k_cache=pb.k_cache,
                              v_cache=pb.v_cache, k_min=k_min, k_max=k_max, block_table=pb.block_table,
                              seq_lens=pb.seq_lens, page_budget=budget, num_sink_pages=sinks,
                              num_recent_pages=recent, backend=TORCH)


# ------------------------------------------------------------------------------------ brute force
def n_pages(n, S_):
    return -(-n // S_)


def brute_logits(pb, b, h, g, t):
    """Scaled logits of query (t, head h*G+g) of row b over the keys it sees: list of (position, logit)."""
    Tq, Hq, D = pb.q.shape[1], pb.q.shape[2], pb.q.shape[3]
    G = Hq // pb.num_kv_heads
    n = int(pb.seq_lens[b])
    qpos = n - Tq + t
    q = pb.q[b, t, h * G + g].double()
    out = []
    for pos in range(min(n, qpos + 1)):
        page = int(pb.block_table[b, pos // pb.page_size])
        k = pb.k_cache[page, pos % pb.page_size, h].double()
        out.append((pos, float(q @ k) / math.sqrt(D)))
    return out


def brute_mass(pb, b, h, pages=None):
    """{page: mass summed over the group and queries}, softmax over the keys of ``pages`` (None = all)."""
    Tq, Hq = pb.q.shape[1], pb.q.shape[2]
    G = Hq // pb.num_kv_heads
    mass = {}
    for t in range(Tq):
        for g in range(G):
            lg = [(p, x) for p, x in brute_logits(pb, b, h, g, t) if pages is None or p // pb.page_size in pages]
            if not lg:
                continue
            m = max(x for _, x in lg)
            z = sum(math.exp(x - m) for _, x in lg)
            for p, x in lg:
                mass[p // pb.page_size] = mass.get(p // pb.page_size, 0.0) + math.exp(x - m) / z
    return mass


def brute_select(n, budget, score, *, sinks=0, recent=1):
    """Forced recent pages, then sinks, then best score (ties to the lower index); ascending list."""
    if n <= budget:
        return list(range(n))
    keep = list(range(n - 1, n - 1 - max(recent, 1), -1))[:budget]
    for j in range(min(sinks, n)):
        if len(keep) < budget and j not in keep:
            keep.append(j)
    rest = sorted((j for j in range(n) if j not in keep), key=lambda j: (-score(j), j))
    keep += rest[: budget - len(keep)]
    return sorted(keep)


def as_lists(idx):
    return [[[int(x) for x in row if x >= 0] for row in head] for head in idx.tolist()]


# ------------------------------------------------------------------------------------ properties
@pytest.mark.parametrize("name", POLICY_NAMES)
@pytest.mark.parametrize("budget,sinks,recent", [(1, 0, 1), (3, 0, 1), (4, 1, 2), (8, 1, 1), (40, 0, 1)])
def test_every_policy_returns_a_valid_selection(name, budget, sinks, recent):
    pb = problem(seed=budget)
    pol = S.get_policy(name)
    ctx = context(pb, budget, sinks=sinks, recent=recent)
    idx = pol.select(ctx)
    if pol.stateful:  # a second step after observing
        pol.observe(ctx, idx, S.page_attention_mass(ctx.q, pb.k_cache, pb.block_table, pb.seq_lens, page_indices=idx))
        idx = pol.select(context(pb, budget, sinks=sinks, recent=recent))
    B, Hkv = pb.block_table.shape[0], pb.num_kv_heads
    assert idx.shape == (B, Hkv, budget) and idx.dtype == torch.int32
    for b in range(B):
        n = n_pages(int(pb.seq_lens[b]), pb.page_size)
        for h in range(Hkv):
            row = idx[b, h].tolist()
            kept = [x for x in row if x >= 0]
            assert row == kept + [-1] * (budget - len(kept)), row            # -1 padding at the end only
            assert kept == sorted(set(kept))                                   # ascending, no duplicate
            assert all(0 <= x < n for x in kept)                               # never past the end
            if n <= budget:
                assert kept == list(range(n))                                  # everything fits: all pages
            else:
                assert len(kept) == budget and n - 1 in kept                   # full budget, last page kept
                assert set(range(n - min(max(recent, 1), budget), n)) <= set(kept)


def test_quest_equals_select_pages_of_page_scores_and_the_fused_op():
    pb = problem(seed=3)
    for budget, sinks in ((2, 0), (5, 1)):
        ctx = context(pb, budget, sinks=sinks)
        k_min, k_max = ctx.k_min, ctx.k_max
        scores = tinyattn.page_scores(ctx.q, k_min, k_max, pb.block_table, pb.seq_lens, page_size=4, backend=TORCH)
        want = tinyattn.select_pages(scores, pb.seq_lens, page_size=4, page_budget=budget, num_sink_pages=sinks,
                                     backend=TORCH)
        assert torch.equal(S.QuestPolicy().select(ctx), want)
        fused = tinyattn.sparse_paged_attention(ctx.q, pb.k_cache, pb.v_cache, pb.block_table, pb.seq_lens,
                                                k_min=k_min, k_max=k_max, page_budget=budget, num_sink_pages=sinks,
                                                backend=TORCH)
        # same pages (checked above); the fused op gathers them in score order, the policy path in page order,
        # so the sums may differ in the last bits
        torch.testing.assert_close(S.attend(S.QuestPolicy(), ctx), fused, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("Tq", [1, 3])
def test_page_attention_mass_matches_brute_force(Tq):
    pb = problem(seed=5, lens=(37, 5, 17), Tq=Tq)
    got = S.page_attention_mass(pb.q, pb.k_cache, pb.block_table, pb.seq_lens)
    sel = torch.tensor([[[0, 3, -1, 9], [1, 2, 4, -1]]] * 3, dtype=torch.int32)
    got_sel = S.page_attention_mass(pb.q, pb.k_cache, pb.block_table, pb.seq_lens, page_indices=sel)
    for b in range(3):
        n = n_pages(int(pb.seq_lens[b]), 4)
        for h in range(2):
            want = brute_mass(pb, b, h)
            for j in range(got.shape[2]):
                assert got[b, h, j].item() == pytest.approx(want.get(j, 0.0), abs=1e-5)
            pages = {p for p in sel[b, h].tolist() if 0 <= p < n}
            want_sel = brute_mass(pb, b, h, pages)
            for k, p in enumerate(sel[b, h].tolist()):
                assert got_sel[b, h, k].item() == pytest.approx(want_sel.get(p, 0.0) if p in pages else 0.0, abs=1e-5)
        assert got[b].sum(-1) == pytest.approx(torch.full((2,), 2.0 * Tq), abs=1e-4)  # G * Tq queries


@pytest.mark.parametrize("budget,sinks,recent", [(2, 0, 1), (4, 1, 1), (5, 0, 3)])
def test_oracle_picks_the_pages_of_most_true_mass(budget, sinks, recent):
    pb = problem(seed=7)
    idx = S.OraclePolicy().select(context(pb, budget, sinks=sinks, recent=recent))
    for b in range(pb.block_table.shape[0]):
        n = n_pages(int(pb.seq_lens[b]), 4)
        for h in range(2):
            mass = brute_mass(pb, b, h)
            assert as_lists(idx)[b][h] == brute_select(n, budget, lambda j: mass.get(j, 0.0), sinks=sinks,
                                                       recent=recent)


@pytest.mark.parametrize("budget,sinks", [(1, 0), (3, 0), (4, 2)])
def test_streaming_is_sinks_plus_recent(budget, sinks):
    pb = problem(seed=8)
    idx = S.StreamingPolicy().select(context(pb, budget, sinks=sinks))
    for b in range(pb.block_table.shape[0]):
        n = n_pages(int(pb.seq_lens[b]), 4)
        n_sink = max(sinks, 1) if budget > 1 else 0
        want = list(range(n)) if n <= budget else sorted(set(range(n_sink)) | set(range(n - budget + n_sink, n)))
        assert as_lists(idx)[b] == [want, want]


def test_meanstd_scores_match_the_formula():
    pb = problem(seed=9)
    pol = S.MeanStdPolicy(alpha=1.5)
    ctx = context(pb, 3)
    got = pol.scores(ctx)
    G = 2
    for b in range(pb.block_table.shape[0]):
        n_tok = int(pb.seq_lens[b])
        for h in range(2):
            for j in range(got.shape[2]):
                if j >= n_pages(n_tok, 4):
                    assert got[b, h, j].item() == float("-inf")
                    continue
                page = int(pb.block_table[b, j])
                keys = pb.k_cache[page, : min(4, n_tok - 4 * j), h].double()          # valid tokens only
                mu, sd = keys.mean(0), keys.std(0, unbiased=False)
                want = max(float(q @ mu + 1.5 * (q.abs() @ sd)) for q in pb.q[b, 0, h * G:(h + 1) * G].double())
                assert got[b, h, j].item() == pytest.approx(want, rel=1e-5, abs=1e-5)
    assert torch.equal(pol.select(ctx), ctx.select_top(got))


# ------------------------------------------------------------------------------------ questmass
def brute_box_estimates(pb, gamma):
    """{(b, t, hq, page): est} from boxes built here over each page's valid keys, in fp64, per query head."""
    B, Tq, Hq, D = pb.q.shape
    Hkv = pb.num_kv_heads
    G = Hq // Hkv
    out = {}
    for b in range(B):
        n = int(pb.seq_lens[b])
        for t in range(Tq):
            seen = max(n - Tq + 1 + t, 0)                                        # keys query t sees
            for j in range(n_pages(seen, pb.page_size)):
                keys = pb.k_cache[int(pb.block_table[b, j]), : min(pb.page_size, n - j * pb.page_size)].double()
                for hq in range(Hq):
                    lo, hi = keys[:, hq // G].amin(0), keys[:, hq // G].amax(0)        # the page's box
                    q = pb.q[b, t, hq].double()
                    out[(b, t, hq, j)] = float(q @ ((lo + hi) / 2) + gamma * (q.abs() @ ((hi - lo) / 2)))
    return out


@settings(max_examples=25, deadline=None)
@given(problems(max_query_tokens=3, page_sizes=(1, 2, 4, 8)), st.sampled_from([0.0, 0.3, 0.75, 1.0]))
def test_box_logit_estimates_match_brute_force_and_bound_every_key_at_gamma_one(pb, gamma):
    k_min, k_max = pb.bounds()
    est = S.box_logit_estimates(pb.q, k_min, k_max, pb.block_table, pb.seq_lens, page_size=pb.page_size,
                                gamma=gamma, backend=TORCH)
    B, Tq, Hq, D = pb.q.shape
    want = brute_box_estimates(pb, gamma)
    G = Hq // pb.num_kv_heads
    for b in range(B):
        n = int(pb.seq_lens[b])
        for t in range(Tq):
            for hq in range(Hq):
                for j in range(est.shape[3]):
                    got = est[b, t, hq, j].item()
                    if (b, t, hq, j) not in want:
                        assert got == float("-inf")                               # past what query t sees
                        continue
                    assert got == pytest.approx(want[(b, t, hq, j)], rel=1e-5, abs=1e-4)
                    keys = pb.k_cache[int(pb.block_table[b, j]), : min(pb.page_size, n - j * pb.page_size)]
                    logits = keys[:, hq // G].double() @ pb.q[b, t, hq].double()
                    if gamma == 1.0:                                              # Quest's bound: an upper bound
                        assert got >= logits.max().item() - 1e-4 * (1 + logits.abs().max().item())


@settings(max_examples=12, deadline=None)
@given(problems(max_query_tokens=2, page_sizes=(1, 2, 4, 8, 16)), st.sampled_from([0.0, 0.75, 1.0]))
@pytest.mark.slow
def test_box_page_log_mass_triton_matches_torch(pb, gamma):
    """The Triton scoring kernel (interpreted) gives the torch backend's estimates."""
    k_min, k_max = pb.bounds()
    args = (pb.q, k_min, k_max, pb.block_table, pb.seq_lens)
    ref = S.box_page_log_mass(*args, page_size=pb.page_size, gamma=gamma, backend=TORCH)
    got = S.box_page_log_mass(*args, page_size=pb.page_size, gamma=gamma, backend="triton")
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("Tq", [1, 3])
def test_box_page_log_mass_is_the_group_sum_of_per_head_softmaxes(Tq):
    pb = problem(seed=15, lens=(37, 5, 0, 17), G=3, Tq=Tq)
    k_min, k_max = pb.bounds()
    gamma, scale = 0.5, 0.3
    got = S.box_page_log_mass(pb.q, k_min, k_max, pb.block_table, pb.seq_lens, page_size=4, gamma=gamma,
                              scale=scale, backend=TORCH)
    est = brute_box_estimates(pb, gamma)
    B, _, Hq, _ = pb.q.shape
    for b in range(B):
        for h in range(2):
            mass = {}
            for t in range(Tq):
                for hq in range(h * 3, h * 3 + 3):
                    row = {j: e for (bb, tt, qq, j), e in est.items() if (bb, tt, qq) == (b, t, hq)}
                    if not row:
                        continue
                    m = max(row.values())
                    z = sum(math.exp(scale * (e - m)) for e in row.values())
                    for j, e in row.items():
                        mass[j] = mass.get(j, 0.0) + math.exp(scale * (e - m)) / z
            for j in range(got.shape[2]):
                want = math.log(mass[j]) if j in mass else float("-inf")
                assert got[b, h, j].item() == pytest.approx(want, abs=1e-5)
        if int(pb.seq_lens[b]) >= Tq:                                             # every query sees a key
            assert got[b].exp().sum(-1) == pytest.approx(torch.full((2,), 3.0 * Tq), abs=1e-4)


def test_questmass_with_one_head_per_group_and_gamma_one_selects_quests_pages():
    pb = problem(seed=16, G=1)
    for budget, sinks in ((2, 0), (3, 1), (5, 0)):
        ctx = context(pb, budget, sinks=sinks)
        assert torch.equal(S.QuestMassPolicy(gamma=1.0).select(ctx), S.QuestPolicy().select(ctx))


def test_questmass_selects_the_top_of_its_scores_and_weighs_every_head_of_the_group():
    # two pages besides the forced last one; head 0's logits are large on both (its bound prefers page 0 by a
    # little), head 1 puts nearly all its attention on page 1. quest (max over the group) keeps page 0;
    # questmass (sum of the heads' shares) keeps page 1, where the group's attention mass is.
    D, S_ = 2, 1
    k_cache = torch.tensor([[[[10.0, 0.0]]], [[[9.0, 5.0]]], [[[0.0, 0.0]]]])       # [3 pages, 1 slot, Hkv=1, D]
    q = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])                                    # [B=1, Hq=2, D]
    table = torch.tensor([[0, 1, 2]], dtype=torch.int32)
    lens = torch.tensor([3], dtype=torch.int32)
    k_min = k_max = k_cache[:, 0]
    ctx = S.SelectionContext(layer=0, q=q, k_cache=k_cache, v_cache=k_cache, k_min=k_min, k_max=k_max,
                             block_table=table, seq_lens=lens, page_budget=2, backend=TORCH)
    assert S.QuestPolicy().select(ctx).tolist() == [[[0, 2]]]
    pol = S.QuestMassPolicy()
    assert pol.select(ctx).tolist() == [[[1, 2]]]
    assert torch.equal(pol.select(ctx), ctx.select_top(pol.scores(ctx)))
    oracle = S.OraclePolicy().select(ctx)
    assert oracle.tolist() == [[[1, 2]]]


@pytest.mark.parametrize("gamma", [-0.1, 1.5, float("nan"), "1", True])
def test_questmass_rejects_a_bad_gamma(gamma):
    with pytest.raises(ValueError, match="gamma"):
        S.QuestMassPolicy(gamma=gamma)
    pb = problem(seed=17)
    k_min, k_max = pb.bounds()
    with pytest.raises(ValueError, match="gamma"):
        S.box_page_log_mass(pb.q, k_min, k_max, pb.block_table, pb.seq_lens, page_size=4, gamma=gamma)


def test_h2o_running_score_and_eviction_against_brute_force():
    """Decode 30 steps of 2 rows; at each step H2O == a Python simulation of accumulated mass + eviction."""
    S_, budget, recent_ratio = 2, 4, 0.5
    full = problem(seed=11, lens=(60, 60), page_size=S_, Hkv=2, G=2)
    pol = S.H2OPolicy(recent_ratio=recent_ratio)
    score = {}                       # (b, h, page) -> accumulated mass
    evicted = set()
    g = torch.Generator().manual_seed(0)
    for step, n_tok in enumerate(range(3, 33)):
        lens = torch.tensor([n_tok, n_tok - 2], dtype=torch.int32)
        q = torch.randn(2, 1, 4, 8, generator=g)
        pb = type(full)(q, full.k_cache, full.v_cache, full.block_table, lens, S_)
        ctx = context(pb, budget, layer=1)
        idx = pol.select(ctx)
        recent = max(1, int(budget * recent_ratio))
        for b in range(2):
            n = n_pages(int(lens[b]), S_)
            for h in range(2):
                cand = lambda j: -math.inf if (b, h, j) in evicted else score.get((b, h, j), 0.0)  # noqa: E731
                want = brute_select(n, budget, cand, recent=recent)
                assert as_lists(idx)[b][h] == want, (step, b, h)
                evicted |= {(b, h, j) for j in range(n) if j not in want}
                for j, m in brute_mass(pb, b, h, set(want)).items():
                    score[(b, h, j)] = score.get((b, h, j), 0.0) + m
        pol.observe(ctx, idx, S.page_attention_mass(ctx.q, pb.k_cache, pb.block_table, lens, page_indices=idx))
    assert evicted, "the budget never forced an eviction"
    pol.reset()
    assert not pol._score


def test_random_is_seeded_and_reset_replays():
    pb = problem(seed=12)
    a = S.RandomPolicy(seed=4)
    first = [a.select(context(pb, 3)) for _ in range(3)]
    a.reset()
    again = [a.select(context(pb, 3)) for _ in range(3)]
    assert all(torch.equal(x, y) for x, y in zip(first, again))
    assert not torch.equal(first[0], first[1])
    assert not torch.equal(first[0], S.RandomPolicy(seed=5).select(context(pb, 3)))


# ------------------------------------------------------------------------------------ metrics
def test_oracle_vs_itself_has_hit_rate_one_and_all_pages_capture_all_mass():
    pb = problem(seed=13)
    ctx = context(pb, 3, layer=2)
    metrics = S.SelectionMetrics()
    metrics.record(ctx, S.OraclePolicy().select(ctx))
    assert metrics.hit_rate == 1.0 and metrics.samples == 3 * 2  # rows 0, 2 and 4 hold more than 3 pages
    mass = ctx.true_page_mass()
    everything = torch.arange(mass.shape[2]).expand(mass.shape).to(torch.int32)
    n = ctx.valid_pages()[:, None, None]
    everything = torch.where(everything < n, everything, -1)
    hit, n_oracle, captured = S.selection_overlap(everything, everything, mass)
    nonempty = ctx.seq_lens > 0
    assert torch.allclose(captured[nonempty], torch.ones_like(captured[nonempty]), atol=1e-5)
    assert torch.equal(hit, n_oracle)


def test_hit_rate_and_captured_mass_against_brute_force():
    pb = problem(seed=14)
    ctx = context(pb, 3)
    sel = S.StreamingPolicy().select(ctx)
    metrics = S.SelectionMetrics()
    metrics.record(ctx, sel)
    hits = oracle_n = 0
    caught, count = 0.0, 0
    for b in range(pb.block_table.shape[0]):
        n = n_pages(int(pb.seq_lens[b]), 4)
        if n <= 3:
            continue
        for h in range(2):
            mass = brute_mass(pb, b, h)
            oracle = brute_select(n, 3, lambda j: mass.get(j, 0.0))
            mine = as_lists(sel)[b][h]
            hits += len(set(mine) & set(oracle))
            oracle_n += len(oracle)
            caught += sum(mass.get(j, 0.0) for j in mine) / sum(mass.values())
            count += 1
    assert metrics.hit_rate == pytest.approx(hits / oracle_n)
    assert metrics.captured_mass == pytest.approx(caught / count, abs=1e-5)
    assert 0 < metrics.hit_rate < 1


def test_get_policy_and_cli_names():
    from tinyattn.cli import _POLICY_NAMES

    assert tuple(S.POLICIES) == _POLICY_NAMES
    for name in POLICY_NAMES:
        assert S.get_policy(name).name == name
    h = S.H2OPolicy()
    assert S.get_policy(h) is h
    with pytest.raises(ValueError, match="policy"):
        S.get_policy("lru")
