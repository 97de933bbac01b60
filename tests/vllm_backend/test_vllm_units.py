"""The vLLM backend's pieces that need no vLLM (they run in the main suite too): settings from the environment,
tinyattn pages over vLLM's blocks, K/V writes with incremental page boxes, per-step planning of mixed
prefill/decode batches, each against ``tinyattn.reference``, the persistent step tables, CUDA-graph decode batches
and the absence of host syncs in the per-layer calls; in vLLM's venv also the metadata builder (declared CUDA-graph
support, buffers kept across steps) and the implementation's per-layer calls, on metadata built by hand."""

import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import tinyattn.reference as ref
from tinyattn.integrations.vllm import enabled, settings_from_env
from tinyattn.integrations.vllm.paging import (attend_groups, block_pools, box_views, make_boxes, plan_groups,
                                               uniform_decode_rows, write_kv)
from tinyattn.integrations.vllm import paging
from tinyattn.integrations.vllm.step_tables import StepTables
from tinyattn.layer import DEFAULT_GAMMA, PagedAttention, SparsityConfig


# ---- settings -------------------------------------------------------------------------------------------
def test_settings_default_dense_and_parsed():
    s = settings_from_env({})
    assert s.page_budget is None and s.num_sink_pages == 1 and s.num_recent_pages == 1 and s.dense_layers == 0
    assert settings_from_env({"TINYATTN_PAGE_BUDGET": "0"}).page_budget is None
    s = settings_from_env({"TINYATTN_PAGE_BUDGET": " 64 ", "TINYATTN_SINK_PAGES": "1", "TINYATTN_RECENT_PAGES": "2",
                           "TINYATTN_DENSE_LAYERS": "2"})
    assert (s.page_budget, s.num_sink_pages, s.num_recent_pages, s.dense_layers) == (64, 1, 2, 2)


@pytest.mark.parametrize("name", ["TINYATTN_PAGE_BUDGET", "TINYATTN_SINK_PAGES", "TINYATTN_RECENT_PAGES",
                                  "TINYATTN_DENSE_LAYERS"])
@pytest.mark.parametrize("bad", ["abc", "-1", "1.5"])
def test_bad_setting_names_the_variable_and_the_allowed_values(name, bad):
    with pytest.raises(ValueError, match=rf"^{name}: expected an integer >= 0 .*got '{bad}'"):
        settings_from_env({"TINYATTN_PAGE_BUDGET": "8", name: bad})


def test_gamma_and_top_p_from_the_environment():
    s = settings_from_env({})
    assert (s.gamma, s.top_p) == (DEFAULT_GAMMA, None)
    # a value other than the recipe's default (0.25), so that reading the variable is what the test sees
    s = settings_from_env({"TINYATTN_PAGE_BUDGET": "8", "TINYATTN_GAMMA": " 0.5 ", "TINYATTN_TOP_P": "0.9"})
    assert (s.page_budget, s.gamma, s.top_p) == (8, 0.5, 0.9)
    assert settings_from_env({"TINYATTN_GAMMA": "1"}).gamma == 1.0              # Quest's bound, asked for
    assert settings_from_env({"TINYATTN_PAGE_BUDGET": "8", "TINYATTN_TOP_P": "1"}).top_p == 1.0
    assert settings_from_env({"TINYATTN_GAMMA": "0"}).gamma == 0


@pytest.mark.parametrize("env, named, need", [
    ({"TINYATTN_TOP_P": "0.9"}, "TINYATTN_TOP_P", "TINYATTN_PAGE_BUDGET"),
    ({"TINYATTN_PAGE_BUDGET": "0", "TINYATTN_RERANK": "int4"}, "TINYATTN_RERANK", "TINYATTN_PAGE_BUDGET"),
    ({"TINYATTN_TOP_P": "0.9", "TINYATTN_RERANK": "int4", "TINYATTN_CANDIDATES": "2"},
     "TINYATTN_TOP_P, TINYATTN_RERANK", "TINYATTN_PAGE_BUDGET"),
    ({"TINYATTN_PAGE_BUDGET": "8", "TINYATTN_CANDIDATES": "2"}, "TINYATTN_CANDIDATES", "TINYATTN_RERANK=int4"),
])
def test_settings_nothing_would_read_name_the_variables(env, named, need):
    """A dense run (no budget) would ignore top-p and the re-rank, a run without the re-rank its candidates: the
    variables are named, as the library's own options are."""
    with pytest.raises(ValueError, match=rf"^{named}: set without {need}"):
        settings_from_env(env)


@pytest.mark.parametrize("name, bad, bound", [
    *(("TINYATTN_GAMMA", bad, r"\[0, 1\]") for bad in ("1.5", "-0.1", "nan", "abc")),
    *(("TINYATTN_TOP_P", bad, r"\(0, 1\]") for bad in ("0", "1.2", "inf", "most"))])
def test_bad_gamma_or_top_p_names_the_variable_and_the_range(name, bad, bound):
    with pytest.raises(ValueError, match=rf"^{name}: expected a number in {bound} .*got '{bad}'"):
        settings_from_env({"TINYATTN_PAGE_BUDGET": "8", name: bad})


def test_budget_too_small_for_the_kept_pages():
    with pytest.raises(ValueError, match=r"TINYATTN_PAGE_BUDGET: expected at least TINYATTN_SINK_PAGES \+ "
                                         r"max\(TINYATTN_RECENT_PAGES, 1\) = 2 \+ 2 = 4 .*got 3"):
        settings_from_env({"TINYATTN_PAGE_BUDGET": "3", "TINYATTN_SINK_PAGES": "2", "TINYATTN_RECENT_PAGES": "2"})


def test_switch():
    assert not enabled({}) and not enabled({"TINYATTN_VLLM": "0"}) and not enabled({"TINYATTN_VLLM": ""})
    assert enabled({"TINYATTN_VLLM": "1"})
    with pytest.raises(ValueError, match=r"TINYATTN_VLLM: expected 1 .* or 0 / unset .*got 'yes'"):
        enabled({"TINYATTN_VLLM": "yes"})


def test_register_is_inert_without_the_switch(monkeypatch):
    from tinyattn.integrations.vllm import register

    monkeypatch.delenv("TINYATTN_VLLM", raising=False)
    monkeypatch.setenv("TINYATTN_PAGE_BUDGET", "not read")     # settings are not even parsed
    assert register() is False


# ---- pages over vLLM's blocks ---------------------------------------------------------------------------
def vllm_cache(num_blocks, H, page_size, D, order="LBHNC"):
    """A per-layer cache as vLLM 0.32 makes it: logical [num_blocks, H, page_size, 2D] over block-compact memory
    (vLLM's [B, H, N, C] with N = page_size tokens)."""
    if order == "LBHNC":
        return torch.zeros(num_blocks, H, page_size, 2 * D)
    return torch.zeros(num_blocks, page_size, H, 2 * D).permute(0, 2, 1, 3)  # LBNHC: [B, N, H, C] in memory


@pytest.mark.parametrize("order", ["LBHNC", "LBNHC"])
def test_pages_live_inside_their_block(order):
    B, H, page_size, D = 5, 2, 4, 3
    kv = vllm_cache(B, H, page_size, D, order)
    k_cache, v_cache = block_pools(kv, H, D, page_size)
    assert k_cache.shape == v_cache.shape == (2 * B - 1, page_size, H, D)
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    k_cache[6].fill_(1.0)            # keys of block 3
    v_cache[6].fill_(2.0)            # values of block 3 (tinyattn page 6 of v_cache)
    assert kv[3].sum() == page_size * H * D * 3 and kv.sum() == page_size * H * D * 3
    kv[3].zero_()                    # what vLLM does to a new block: only block 3's pages change
    assert k_cache.abs().sum() == 0 and v_cache.abs().sum() == 0


def test_padded_or_interleaved_blocks_are_refused():
    padded = torch.zeros(4, 2, 4, 2 * 3 + 1)[..., :6]
    with pytest.raises(ValueError, match="kv_cache: expected blocks stored as one dense, unpadded run"):
        block_pools(padded, 2, 3, 4)
    block_outer = torch.zeros(4, 2, 2, 4, 6).select(1, 0)            # blocks of two layers interleaved
    with pytest.raises(ValueError, match="one dense, unpadded run"):
        block_pools(block_outer, 2, 3, 4)


# ---- writes and boxes -----------------------------------------------------------------------------------
class FakeVllm:
    """vLLM's block bookkeeping in miniature: a free list (reused blocks first), block tables, slot mappings."""

    def __init__(self, num_blocks, block_size):
        self.free = list(range(num_blocks))
        torch.manual_seed(0)
        self.free = [self.free[i] for i in torch.randperm(num_blocks).tolist()]
        self.block_size = block_size
        self.blocks, self.lens = {}, {}

    def schedule(self, req, n):
        """Slots of ``n`` new tokens of ``req`` (allocating blocks)."""
        blocks, start = self.blocks.setdefault(req, []), self.lens.get(req, 0)
        slots = []
        for t in range(start, start + n):
            if t // self.block_size >= len(blocks):
                blocks.append(self.free.pop(0))
            slots.append(blocks[t // self.block_size] * self.block_size + t % self.block_size)
        self.lens[req] = start + n
        return torch.tensor(slots)

    def release(self, req):
        self.free = self.blocks.pop(req) + self.free
        self.lens.pop(req)

    def tables(self, reqs):
        width = max(len(self.blocks[r]) for r in reqs)
        bt = torch.zeros(len(reqs), width, dtype=torch.int32)        # vLLM pads with 0, not -1
        for i, r in enumerate(reqs):
            bt[i, : len(self.blocks[r])] = torch.tensor(self.blocks[r])
        return bt, torch.tensor([self.lens[r] for r in reqs], dtype=torch.int32)


def test_writes_and_boxes_match_the_reference_through_block_reuse():
    B, H, page_size, D = 12, 2, 4, 8
    kv = vllm_cache(B, H, page_size, D, "LBNHC")
    k_cache, v_cache = block_pools(kv, H, D, page_size)
    boxes = make_boxes(B, H, D, dtype=torch.float32, device="cpu")
    vl = FakeVllm(B, page_size)
    keys: dict = {}

    def step(plan):
        """plan: [(req, n_tokens)]; one write of all of them (with a padding slot), as one vLLM step."""
        slots, ks, vs = [], [], []
        for req, n in plan:
            k, v = torch.randn(n, H, D) * (1 + req), torch.randn(n, H, D)
            keys.setdefault(req, []).append((k, v))
            slots.append(vl.schedule(req, n)), ks.append(k), vs.append(v)
        slots = torch.cat(slots + [torch.tensor([-1])])
        write_kv(k_cache, v_cache, boxes, torch.cat(ks + [torch.full((1, H, D), 1e9)]),
                 torch.cat(vs + [torch.full((1, H, D), 1e9)]), slots, page_size)

    def check(reqs):
        bt, sl = vl.tables(reqs)
        k_min, k_max = box_views(boxes)
        ref_min, ref_max = torch.full_like(k_min, float("inf")), torch.full_like(k_max, float("-inf"))
        ref.update_page_metadata(k_cache, bt * 2, sl, ref_min, ref_max)
        for i, r in enumerate(reqs):
            want_k = torch.cat([k for k, _ in keys[r]])
            want_v = torch.cat([v for _, v in keys[r]])
            for t in range(int(sl[i])):
                page, slot = 2 * int(bt[i, t // page_size]), t % page_size
                assert torch.equal(k_cache[page, slot], want_k[t]) and torch.equal(v_cache[page, slot], want_v[t])
            pages = 2 * bt[i, : -(-int(sl[i]) // page_size)].long()
            assert torch.equal(k_min[pages], ref_min[pages]) and torch.equal(k_max[pages], ref_max[pages])

    step([(0, 7), (1, 3)])                 # two prefills
    step([(0, 1), (1, 1), (2, 9)])         # decodes + a prefill
    check([0, 1, 2])
    vl.release(0)                          # request 0 done: its blocks go back, and are reused first
    keys.pop(0)
    step([(3, 6), (1, 1), (2, 1)])
    step([(3, 1)])
    check([1, 2, 3])



def test_rerank_settings_from_the_environment():
    s = settings_from_env({"TINYATTN_PAGE_BUDGET": "8", "TINYATTN_RERANK": "int4", "TINYATTN_CANDIDATES": "1.5"})
    assert (s.rerank, s.candidates) == ("int4", 1.5)
    assert settings_from_env({"TINYATTN_RERANK": "none"}).rerank is None and settings_from_env({}).rerank is None
    with pytest.raises(ValueError, match=r"^TINYATTN_RERANK: expected int4, none or unset .*got 'int8'"):
        settings_from_env({"TINYATTN_PAGE_BUDGET": "8", "TINYATTN_RERANK": "int8"})
    for bad in ("0.5", "abc", "inf"):
        with pytest.raises(ValueError, match=rf"^TINYATTN_CANDIDATES: expected a number >= 1 .*got '{bad}'"):
            settings_from_env({"TINYATTN_PAGE_BUDGET": "8", "TINYATTN_RERANK": "int4", "TINYATTN_CANDIDATES": bad})


def test_key_codes_match_the_reference_and_a_rerank_step_matches_the_op():
    """With ``rerank="int4"`` the backend keeps 4-bit key codes beside the boxes: every block a step fills gets the
    reference encoder's codes (read through :func:`paging.code_views`, indexed like the pools), through block reuse
    and a padding slot; and a decode step attends over the pages of the public op's re-ranked selection."""
    B, H, page_size, D = 12, 2, 4, 8
    kv = vllm_cache(B, H, page_size, D, "LBNHC")
    k_cache, v_cache = block_pools(kv, H, D, page_size)
    boxes = make_boxes(B, H, D, dtype=torch.float32, device="cpu")
    codes = paging.make_codes(B, H, D, page_size, device="cpu")
    vl = FakeVllm(B, page_size)

    def step(plan):
        slots = torch.cat([vl.schedule(r, n) for r, n in plan] + [torch.tensor([-1])])
        n = slots.shape[0]
        write_kv(k_cache, v_cache, boxes, torch.randn(n, H, D), torch.randn(n, H, D), slots, page_size, codes)

    step([(0, 7), (1, 3)])
    step([(0, 1), (1, 1), (2, 9)])
    vl.release(0)
    step([(3, 6), (1, 1), (2, 3)])
    reqs = [1, 2, 3]
    bt, sl = vl.tables(reqs)
    k_min, k_max = box_views(boxes)
    k_code = paging.code_views(codes)
    assert k_code.shape == (2 * B - 1, page_size, H, D // 2)
    want = torch.zeros_like(k_code)
    full = [2 * int(bt[i, j]) for i in range(len(reqs)) for j in range(int(sl[i]) // page_size)]
    ref.encode_key_codes(k_cache, torch.tensor([p * page_size + page_size - 1 for p in full]), k_min, k_max, want)
    assert full and all(torch.equal(k_code[p], want[p]) for p in full)
    # one decode step of the three requests, sparse with the re-rank
    slots = torch.cat([vl.schedule(r, 1) for r in reqs])
    write_kv(k_cache, v_cache, boxes, torch.randn(3, H, D), torch.randn(3, H, D), slots, page_size, codes)
    bt, sl = vl.tables(reqs)
    sparsity = SparsityConfig(page_budget=2, num_sink_pages=0, rerank="int4", top_p=0.6)
    groups = plan_groups(torch.arange(4), bt, sl, make_attention=lambda tq, fresh: PagedAttention(sparsity,
                         backend="torch"), num_q_heads=4, num_kv_heads=H, head_dim=D, page_size=page_size,
                         scale=D ** -0.5)
    query = torch.randn(3, 4, D)
    output = attend_groups(groups, 0, query, torch.empty(3, 4, D), k_cache, v_cache, k_min, k_max, D ** -0.5,
                           k_code=k_code)
    import tinyattn
    want = tinyattn.sparse_paged_attention(query, k_cache, v_cache, bt * 2, sl, k_min=k_min, k_max=k_max,
                                           page_budget=2, rerank="int4", top_p=0.6, gamma=DEFAULT_GAMMA,
                                           k_code=k_code, backend="torch")
    torch.testing.assert_close(output, want, atol=1e-5, rtol=1e-5)

# ---- planning a mixed step ------------------------------------------------------------------------------
@pytest.mark.parametrize("page_budget", [None, 2])
@pytest.mark.parametrize("window_left", [-1, 4])
@pytest.mark.parametrize("persistent", [False, True])
def test_mixed_prefill_decode_step_matches_the_reference(page_budget, window_left, persistent):
    """Rows in vLLM's order (decodes first, then prefills: fresh ones and ones with cached context, one length
    three times, apart): every row's output equals the reference op run on that row alone (dense, or sparse at
    decode), the fresh prefills (causal SDPA on the step's keys) included.

    A sliding layer (``window_left`` 4: 5 tokens) is dense over its window whatever the budget, and the entries of
    its block table wholly before the window point at a block poisoned with NaN: vLLM's sliding-window KV manager
    frees those blocks and reuses them while the table still lists their old ids, so they must not be read.
    ``persistent``: the tables go through the builder's :class:`StepTables` (wider than vLLM's table) and give the
    same outputs."""
    torch.manual_seed(1)
    B, Hq, H, page_size, D = 40, 4, 2, 4, 8
    contexts = {0: 13, 1: 6, 2: 0, 3: 9, 4: 0, 5: 6}      # tokens already in the cache
    query_lens = {0: 1, 1: 1, 2: 5, 3: 3, 4: 5, 5: 5}     # 2 decodes, fresh prefills of 5, chunks of 3 and 5
    kv, k_cache, v_cache, boxes, vl = cache_with_contexts(contexts, B, H, page_size, D)
    reqs = list(query_lens)
    slots = torch.cat([vl.schedule(r, query_lens[r]) for r in reqs])
    T = slots.shape[0]
    step_k, step_v = torch.randn(T, H, D), torch.randn(T, H, D)
    write_kv(k_cache, v_cache, boxes, step_k, step_v, slots, page_size)
    bt, sl = vl.tables(reqs)
    qsl = torch.tensor([0] + [query_lens[r] for r in reqs]).cumsum(0)
    vllm_bt = bt.clone()
    if window_left >= 0:
        kv[0] = float("nan")
        for i, r in enumerate(reqs):                      # blocks wholly before the first query's window
            first_key = int(sl[i]) - query_lens[r] - window_left
            vllm_bt[i, : max(first_key, 0) // page_size] = 0
        assert (vllm_bt == 0).any()
    sparsity = SparsityConfig(page_budget=page_budget)
    made = {}

    def make(tq, fresh):
        return made.setdefault((tq, fresh), PagedAttention(sparsity, backend="torch"))

    tables = StepTables(8, vllm_bt.shape[1] + 1, device="cpu") if persistent else None
    groups = plan_groups(qsl, vllm_bt, sl, make_attention=make, num_q_heads=Hq, num_kv_heads=H, head_dim=D,
                         page_size=page_size, scale=D ** -0.5, tables=tables)
    assert [(g.num_query_tokens, g.num_rows) for g in groups] == [(1, 2), (3, 1), (5, 1), (5, 2)]
    assert groups[2].attn is not groups[3].attn              # a fresh prefill group has a plan of its own
    assert groups[3].attn.plan._impl._fresh and not groups[2].attn.plan._impl._fresh
    assert isinstance(groups[0].tokens, slice) and not isinstance(groups[3].tokens, slice)
    query = torch.randn(T, Hq, D)
    output = torch.full((T, Hq, D), float("nan"))
    k_min, k_max = box_views(boxes)
    attend_groups(groups, 0, query, output, k_cache, v_cache, k_min, k_max, D ** -0.5,
                  window_left=window_left)
    for i, r in enumerate(reqs):
        tq = query_lens[r]
        q = query[int(qsl[i]): int(qsl[i + 1])][None]
        q = q[:, 0] if tq == 1 else q
        row_bt, row_sl = bt[i: i + 1] * 2, sl[i: i + 1]
        if tq == 1 and page_budget and window_left < 0:
            want = ref.sparse_paged_attention(q, k_cache, v_cache, row_bt, row_sl, k_min=k_min, k_max=k_max,
                                              page_budget=page_budget)
        else:
            want = ref.paged_attention(q, k_cache, v_cache, row_bt, row_sl, window_left=window_left)
        got = output[int(qsl[i]): int(qsl[i + 1])]
        torch.testing.assert_close(got, want.reshape(got.shape), atol=1e-5, rtol=1e-5)


def test_throughput_bench_has_a_help():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "bench" / "vllm_throughput.py"
    spec = importlib.util.spec_from_file_location("bench_vllm_throughput", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)                # imports no vLLM at module level
    with pytest.raises(SystemExit) as exc:
        module.main(["--help"])
    assert exc.value.code == 0


# ---- no host sync per layer, persistent step tables, CUDA-graph batches --------------------------------------
_SYNCS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__", "nonzero")


class _HostReads(TorchDispatchMode):
    """Records every op that reads a tensor's value on the host or gives a value-dependent shape, including those
    made inside PyTorch's C++ (``aten._local_scalar_dense`` is what ``item()``, ``bool()`` and a 0-dim index run)."""

    def __init__(self, found):
        super().__init__()
        self.found = found

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__
        if name.startswith(("_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique")) or (
                name.startswith(("index.", "index_put")) and any(
                    isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] if len(args) > 1 else ())
                    if i is not None)):
            self.found.append(name)
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def no_host_sync(monkeypatch):
    """Patch the Tensor methods that read values on the host (as tests/ops/test_plan.py does) and record the aten ops
    that do; yields the list of what was called (empty = no host sync, no value-dependent shape)."""
    found = []

    def forbid(name):
        real = getattr(torch.Tensor, name)

        def wrapped(self, *a, **kw):
            found.append(name)
            return real(self, *a, **kw)
        return wrapped

    with monkeypatch.context() as m:
        for name in _SYNCS:
            m.setattr(torch.Tensor, name, forbid(name))
        m.setattr(torch, "nonzero", forbid("nonzero"))
        with _HostReads(found):
            yield found


def cache_with_contexts(contexts: dict, B: int, H: int, page_size: int, D: int):
    """A vLLM cache of ``B`` blocks whose request ``r`` already holds ``contexts[r]`` random tokens (written through
    :func:`write_kv`, boxes kept): ``(kv, k_cache, v_cache, boxes, FakeVllm)``; block 0 (the null block) never given."""
    kv = vllm_cache(B, H, page_size, D)
    k_cache, v_cache = block_pools(kv, H, D, page_size)
    boxes = make_boxes(B, H, D, dtype=torch.float32, device="cpu")
    vl = FakeVllm(B, page_size)
    vl.free.remove(0)                                     # the null block is never a request's
    for r, n in contexts.items():
        if n:
            write_kv(k_cache, v_cache, boxes, torch.randn(n, H, D), torch.randn(n, H, D), vl.schedule(r, n), page_size)
        else:
            vl.blocks[r], vl.lens[r] = [], 0
    return kv, k_cache, v_cache, boxes, vl


def mixed_step(seed=2, B=40, Hq=4, H=2, page_size=4, D=8):
    """A step of a mixed batch written into a vLLM cache: (kv, k_cache, v_cache, boxes, qsl, vllm block table, seq_lens,
    query, step keys, step values, slots); the rows: 2 decodes, a fresh prefill of 5, a chunk of 3 into a cache of 9
    tokens, and two padding tokens at the end (slot -1), as vLLM's piecewise padding leaves them."""
    torch.manual_seed(seed)
    contexts, query_lens = {0: 13, 1: 6, 2: 0, 3: 9}, {0: 1, 1: 1, 2: 5, 3: 3}
    kv, k_cache, v_cache, boxes, vl = cache_with_contexts(contexts, B, H, page_size, D)
    reqs = list(query_lens)
    slots = torch.cat([vl.schedule(r, query_lens[r]) for r in reqs] + [torch.tensor([-1, -1])])
    T = slots.shape[0]
    bt, sl = vl.tables(reqs)
    qsl = torch.tensor([0] + [query_lens[r] for r in reqs]).cumsum(0)
    return (kv, k_cache, v_cache, boxes, qsl, bt, sl, torch.randn(T, Hq, D), torch.randn(T, H, D), torch.randn(T, H, D),
            slots)


@pytest.mark.parametrize("page_budget", [None, 2])
@pytest.mark.parametrize("window_left", [-1, 4])
def test_per_layer_calls_make_no_host_sync(monkeypatch, page_budget, window_left):
    """write_kv and attend_groups (each group's plan.run: decode, chunked and fresh prefill, sliding window) read no
    tensor value on the host and make no value-dependent shape: the builder (plan_groups) reads them once per step.
    The first layer's attention runs unwatched: a plan may build per-step tables lazily at its first run (the plan's
    own contract, tests/ops/test_plan.py); every write and every later layer is watched."""
    kv, k_cache, v_cache, boxes, qsl, bt, sl, query, step_k, step_v, slots = mixed_step()
    H, D = k_cache.shape[-2:]
    made = {}
    groups = plan_groups(qsl, bt, sl, make_attention=lambda tq, fresh: made.setdefault((tq, fresh), PagedAttention(
        SparsityConfig(page_budget=page_budget), backend="torch")), num_q_heads=4, num_kv_heads=H, head_dim=D,
        page_size=4, scale=D ** -0.5, tables=StepTables(8, bt.shape[1], device="cpu"))
    output = torch.zeros_like(query)
    k_min, k_max = box_views(boxes)
    found = []
    for layer in range(3):
        with no_host_sync(monkeypatch) as seen:
            write_kv(k_cache, v_cache, boxes, step_k, step_v, slots, 4)
        found += seen
        with no_host_sync(monkeypatch) if layer else contextlib.nullcontext([]) as seen:
            attend_groups(groups, layer, query, output, k_cache, v_cache, k_min, k_max, D ** -0.5,
                          window_left=window_left)
        found += seen
    assert found == []
    assert torch.isfinite(output).all()


def test_host_sync_probe_sees_what_it_must():
    """The probe itself: a 0-dim index, bool(), a boolean mask and nonzero are all caught (C++ paths included)."""
    x = torch.arange(6.0)
    for f in (lambda: x[torch.tensor(2)], lambda: bool((x > 2).any()), lambda: x[x > 2], lambda: x.nonzero(),
              lambda: x.tolist()):
        mp = pytest.MonkeyPatch()
        with no_host_sync(mp) as found:
            f()
        mp.undo()
        assert found, f


@pytest.mark.parametrize("case", ["trailing", "middle", "only_padding", "block_0_slot_0"])
def test_padding_slots_leave_memory_bit_identical(case):
    """Padding slots (-1) write nothing: vLLM's memory outside the real slots and the visible boxes are unchanged,
    also when the step has no real token or a real token writes block 0's slot 0 (where slot -1 is clamped)."""
    B, H, page_size, D = 6, 2, 4, 8
    kv = vllm_cache(B, H, page_size, D)
    kv.normal_()
    kv[5] = float("nan")                                   # a poisoned block (NaN != NaN: compared bitwise below)
    k_cache, v_cache = block_pools(kv, H, D, page_size)
    boxes = make_boxes(B, H, D, dtype=torch.float32, device="cpu")
    slots = {"trailing": [9, 10, -1, -1], "middle": [-1, 9, -1, 10], "only_padding": [-1, -1, -1],
             "block_0_slot_0": [-1, 0, 1, -1]}[case]
    slots = torch.tensor(slots)
    key, value = torch.randn(len(slots), H, D), torch.randn(len(slots), H, D)
    before = kv.clone()
    write_kv(k_cache, v_cache, boxes, key, value, slots, page_size)
    want = before.clone()
    want_k, want_v = block_pools(want, H, D, page_size)
    k_min, k_max = box_views(boxes)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            want_k[2 * (s // page_size), s % page_size] = key[t]
            want_v[2 * (s // page_size), s % page_size] = value[t]
    assert torch.equal(kv.view(torch.int32), want.view(torch.int32))
    touched = sorted({s // page_size for s in slots.tolist() if s >= 0})
    for b in range(B):
        page = 2 * b
        if b in touched:     # a box restarted (slot 0 written) or grown from empty: the written keys' box
            keys = torch.stack([key[t] for t, s in enumerate(slots.tolist()) if s >= 0 and s // page_size == b])
            assert torch.equal(k_min[page], keys.amin(0)) and torch.equal(k_max[page], keys.amax(0))
        else:
            assert torch.isinf(k_min[page]).all() and (k_min[page] > 0).all() and (k_max[page] < 0).all()


def test_step_tables_allocated_once_and_values_copied():
    """The buffers are allocated at construction; every step (batches shrinking and growing within capacity)
    copies into the same storage: tinyattn page ids 2 x vLLM's, seq_lens as given, narrower tables zero-filled."""
    tables = StepTables(6, 5, device="cpu")
    bt_ptr, sl_ptr = tables.block_table.data_ptr(), tables.seq_lens.data_ptr()
    torch.manual_seed(0)
    for rows, width in ((3, 5), (1, 5), (6, 5), (2, 3), (4, 7)):
        vllm_bt = torch.randint(0, 50, (rows, width), dtype=torch.int32)
        seq_lens = torch.randint(0, 20, (rows,), dtype=torch.int32)
        bt, sl = tables.load(vllm_bt, seq_lens)
        assert bt.data_ptr() == bt_ptr and sl.data_ptr() == sl_ptr
        assert tables.block_table.data_ptr() == bt_ptr and tables.seq_lens.data_ptr() == sl_ptr
        assert bt.shape == (rows, 5) and bt.dtype == sl.dtype == torch.int32
        cols = min(width, 5)
        assert torch.equal(bt[:, :cols], 2 * vllm_bt[:, :cols]) and (bt[:, cols:] == 0).all()
        assert torch.equal(sl, seq_lens)
    with pytest.raises(ValueError, match=r"block_table: expected at most max_num_seqs=6 rows .*got 7"):
        tables.load(torch.zeros(7, 5, dtype=torch.int32), torch.zeros(7, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"max_pages_per_seq: expected an int >= 1, got 0"):
        StepTables(2, 0, device="cpu")


def test_uniform_decode_rows():
    q = torch.tensor
    assert uniform_decode_rows(q([0, 1, 2, 3, 3, 3]), 5) == 5          # 3 decodes + 2 padding rows
    assert uniform_decode_rows(q([0, 1, 2]), 2) == 2                   # no padding
    assert uniform_decode_rows(q([0, 0, 0]), 2) == 2                   # padding only (vLLM's capture dummy run: -1 slots)
    assert uniform_decode_rows(q([0, 1, 1, 2]), 3) is None             # a padding row before a decode
    assert uniform_decode_rows(q([0, 1, 3]), 3) is None                # a prefill
    assert uniform_decode_rows(q([0, 1, 2, 2]), 4) is None             # tokens != rows
    assert uniform_decode_rows(q([0]), 0) is None


def _backends():
    out = ["torch"]
    try:
        import triton  # noqa: F401
        out.append("triton")                     # under TRITON_INTERPRET=1 (tests/conftest.py) on the CPU
    except ImportError:
        pass
    return out


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("page_budget", [None, 2])
def test_graph_decode_batch_padded_rows_give_zeros(backend, page_budget):
    """A decode batch as vLLM pads it for a CUDA graph (3 decodes + 2 rows of 0 tokens, seq_len 0, null-block rows,
    slots -1) is one decode group over all 5 rows on the persistent tables: the real rows equal the reference, the
    padding rows are 0 (no NaN), and a later, smaller batch of the same size reuses the same plan and storage."""
    B, Hq, H, page_size, D = 24, 4, 2, 4, 8
    torch.manual_seed(3)
    kv = vllm_cache(B, H, page_size, D)
    k_cache, v_cache = block_pools(kv, H, D, page_size)
    boxes = make_boxes(B, H, D, dtype=torch.float32, device="cpu")
    vl = FakeVllm(B, page_size)
    vl.free.remove(0)
    for r, n in enumerate((13, 6, 9)):
        write_kv(k_cache, v_cache, boxes, torch.randn(n, H, D), torch.randn(n, H, D), vl.schedule(r, n), page_size)
    tables = StepTables(8, 6, device="cpu")
    attn = PagedAttention(SparsityConfig(page_budget=page_budget), backend=backend)
    planned = []
    real_plan = attn.plan.plan
    attn.plan.plan = lambda *a, **kw: (planned.append(kw), real_plan(*a, **kw))[1]
    for real in (3, 2):
        reqs = list(range(real))
        slots = torch.cat([vl.schedule(r, 1) for r in reqs] + [torch.full((5 - real,), -1)])
        step_k, step_v = torch.randn(5, H, D), torch.randn(5, H, D)
        write_kv(k_cache, v_cache, boxes, step_k, step_v, slots, page_size)
        bt, sl = vl.tables(reqs)
        bt = torch.cat([torch.nn.functional.pad(bt, (0, 6 - bt.shape[1])), torch.zeros(5 - real, 6, dtype=torch.int32)])
        sl = torch.cat([sl, torch.zeros(5 - real, dtype=torch.int32)])
        qsl = torch.tensor([0] + list(range(1, real + 1)) + [real] * (5 - real))
        rows = uniform_decode_rows(qsl, 5)
        groups = plan_groups(qsl, bt, sl, make_attention=lambda tq, fresh: attn, num_q_heads=Hq, num_kv_heads=H,
                             head_dim=D, page_size=page_size, scale=D ** -0.5, tables=tables, decode_rows=rows)
        assert [(g.num_query_tokens, g.num_rows, g.tokens) for g in groups] == [(1, 5, slice(0, 5))]
        assert groups[0].attn is attn
        # the plan's graph mode: buffers at this capacity, kept
        assert (planned[-1]["max_batch"], planned[-1]["max_pages_per_seq"]) == (5, 6)
        query = torch.randn(5, Hq, D)
        output = torch.full_like(query, float("nan"))
        k_min, k_max = box_views(boxes)
        attend_groups(groups, 0, query, output, k_cache, v_cache, k_min, k_max, D ** -0.5)
        assert torch.equal(output[real:], torch.zeros_like(output[real:]))
        if page_budget:
            want = ref.sparse_paged_attention(query[:real], k_cache, v_cache, 2 * bt[:real], sl[:real], k_min=k_min,
                                              k_max=k_max, page_budget=page_budget, gamma=attn.sparsity.gamma)
        else:
            want = ref.paged_attention(query[:real], k_cache, v_cache, 2 * bt[:real], sl[:real])
        torch.testing.assert_close(output[:real], want, atol=2e-5, rtol=1e-4)
        assert tables.block_table.data_ptr() == tables.block_table[:5].data_ptr()


# ---- the metadata builder and the implementation (vLLM's venv only) -----------------------------------------
@pytest.fixture(scope="module")
def vllm_config(tmp_path_factory):
    """A real VllmConfig of a tiny random Llama (4 query / 2 KV heads, head_dim 8, max_model_len 64), with full
    decode CUDA graphs switched on by hand (vLLM's CPU platform turns them off) at capture sizes 1, 2, 4, 8."""
    pytest.importorskip("vllm.v1.attention.backend")
    transformers = pytest.importorskip("transformers")
    from vllm.config import CUDAGraphMode, ModelConfig, VllmConfig

    out = tmp_path_factory.mktemp("tiny-llama-config")
    transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                             max_position_embeddings=64).save_pretrained(out)
    config = VllmConfig(model_config=ModelConfig(model=str(out), dtype="float32", max_model_len=64,
                                                 skip_tokenizer_init=True))
    config.scheduler_config.max_num_seqs = 6
    config.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
    config.compilation_config.cudagraph_capture_sizes = [1, 2, 4, 8]
    config.compilation_config.max_cudagraph_capture_size = 8
    return config


def make_builder(vllm_config, monkeypatch, graphs: bool, budget: int | None = 2, page_size=4):
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from tinyattn.integrations.vllm.backend import TinyAttnMetadataBuilder

    monkeypatch.setenv("TINYATTN_VLLM_CUDA_GRAPHS", "1" if graphs else "0")
    monkeypatch.setenv("TINYATTN_PAGE_BUDGET", str(budget or 0))
    spec = FullAttentionSpec(block_size=page_size, num_kv_heads=2, head_size=8, dtype=torch.float32)
    return TinyAttnMetadataBuilder(spec, [], vllm_config, torch.device("cpu"), block_table_width=32)


def common_metadata(query_lens, seq_lens, block_table, slot_mapping, num_tokens=None):
    from vllm.v1.attention.backend import CommonAttentionMetadata

    qsl = torch.tensor([0] + list(query_lens), dtype=torch.int32).cumsum(0).to(torch.int32)
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=sl, seq_lens_cpu_upper_bound=sl, num_reqs=len(sl),
        num_actual_tokens=num_tokens or int(qsl[-1]), max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        block_table_tensor=block_table, slot_mapping=slot_mapping)


@pytest.mark.parametrize("value, want", [("1", "UNIFORM_SINGLE_TOKEN_DECODE"), ("0", "NEVER"), (None, "NEVER")])
def test_builder_declares_cuda_graphs_only_with_the_setting(monkeypatch, value, want):
    pytest.importorskip("vllm.v1.attention.backend")
    from tinyattn.integrations.vllm.backend import TinyAttnMetadataBuilder

    if value is None:
        monkeypatch.delenv("TINYATTN_VLLM_CUDA_GRAPHS", raising=False)
    else:
        monkeypatch.setenv("TINYATTN_VLLM_CUDA_GRAPHS", value)
    assert TinyAttnMetadataBuilder.get_cudagraph_support(None, None).name == want


def test_cuda_graphs_setting_parsed(monkeypatch):
    from tinyattn.integrations.vllm import cuda_graphs_enabled, register

    monkeypatch.setenv("TINYATTN_VLLM", "1")
    monkeypatch.setenv("TINYATTN_VLLM_CUDA_GRAPHS", "yes")
    with pytest.raises(ValueError, match=r"^TINYATTN_VLLM_CUDA_GRAPHS: expected 1 "):
        register()                                  # a bad value stops start-up, before vLLM is imported

    assert not cuda_graphs_enabled({}) and not cuda_graphs_enabled({"TINYATTN_VLLM_CUDA_GRAPHS": "0"})
    assert cuda_graphs_enabled({"TINYATTN_VLLM_CUDA_GRAPHS": " 1 "})
    with pytest.raises(ValueError, match=r"TINYATTN_VLLM_CUDA_GRAPHS: expected 1 .* or 0 / unset .*got 'on'"):
        cuda_graphs_enabled({"TINYATTN_VLLM_CUDA_GRAPHS": "on"})


def _step(builder, reqs, vl, query_lens, pad_rows=0):
    """Hand-made CommonAttentionMetadata of one step of ``reqs`` (FakeVllm) with ``query_lens`` new tokens each (the
    slots scheduled here), plus ``pad_rows`` padding rows as vLLM pads a graph batch; returns (metadata, slots)."""
    slots = torch.cat([vl.schedule(r, n) for r, n in zip(reqs, query_lens)] + [torch.full((pad_rows,), -1)])
    bt, sl = vl.tables(reqs)
    bt = torch.nn.functional.pad(bt, (0, 32 - bt.shape[1]))
    bt = torch.cat([bt, torch.zeros(pad_rows, 32, dtype=torch.int32)])
    common = common_metadata(list(query_lens) + [0] * pad_rows, sl.tolist() + [0] * pad_rows, bt, slots,
                             num_tokens=sum(query_lens) + pad_rows)
    return builder.build(0, common), slots


@pytest.mark.parametrize("graphs", [False, True])
def test_builder_keeps_its_buffers_and_plans_graph_batches_over_all_rows(vllm_config, monkeypatch, graphs):
    """Across steps that grow and shrink (a mixed batch, padded decode batches of 4 and 2 rows, an unpadded decode
    batch of 3, which no graph captures, then 1 + 1 padding row and 1), the builder's tables stay where they were allocated and hold the step's
    values (2 x vLLM's block ids); with graphs on, a padded decode batch is one group over all its rows (one plan per
    capture size), without, its padding rows are left out as before. Every output equals the reference; padding
    rows are 0 and nothing is NaN."""
    from tinyattn.integrations.vllm.backend import TinyAttnImpl

    builder = make_builder(vllm_config, monkeypatch, graphs)
    impl = TinyAttnImpl(num_heads=4, head_size=8, scale=8 ** -0.5, num_kv_heads=2)
    layer = type("Layer", (), {"layer_name": "model.layers.1.self_attn.attn"})()
    bt_ptr, sl_ptr = builder.tables.block_table.data_ptr(), builder.tables.seq_lens.data_ptr()
    assert builder.tables.block_table.shape == (8, 32)          # max(max_num_seqs 6, capture size 8) x width
    torch.manual_seed(5)
    kv = vllm_cache(30, 2, 4, 8)
    vl = FakeVllm(30, 4)
    vl.free.remove(0)
    keys = {}
    steps = [([0, 1, 2], [7, 5, 9], 0), ([0, 1, 2], [1, 1, 1], 1), ([0, 1], [1, 1], 0), ([0, 1, 2], [1, 1, 1], 0),
             ([2], [1], 1), ([1], [1], 0)]
    for reqs, query_lens, pad_rows in steps:
        meta, slots = _step(builder, reqs, vl, query_lens, pad_rows)
        T = slots.shape[0]
        key, value, query = torch.randn(T, 2, 8), torch.randn(T, 2, 8), torch.randn(T, 4, 8)
        for t, s in enumerate(slots.tolist()):
            if s >= 0:
                keys[s] = (key[t], value[t])
        impl.do_kv_cache_update(layer, key, value, kv, slots)
        output = torch.full_like(query, float("nan"))
        impl.forward(layer, query, key, value, kv, meta, output)
        assert builder.tables.block_table.data_ptr() == bt_ptr and builder.tables.seq_lens.data_ptr() == sl_ptr
        rows = len(reqs) + pad_rows
        assert torch.equal(builder.tables.seq_lens[:len(reqs)], torch.tensor([vl.lens[r] for r in reqs],
                                                                             dtype=torch.int32))
        bt, sl = vl.tables(reqs)
        assert torch.equal(builder.tables.block_table[:len(reqs), :bt.shape[1]], 2 * bt)
        decode = set(query_lens) == {1}
        padded_graph = graphs and decode and rows in (1, 2, 4, 8)
        if padded_graph:
            assert [(g.num_rows, g.tokens) for g in meta.groups] == [(rows, slice(0, rows))]
            assert meta.groups[0].attn is builder._graph_attention[rows]
            assert torch.equal(output[len(reqs):], torch.zeros_like(output[len(reqs):]))
        else:
            assert sum(g.num_rows for g in meta.groups) == len(reqs)
        k_cache, v_cache = block_pools(kv, 2, 8, 4)
        k_min, k_max = box_views(impl._pools(kv)[3])
        start = 0
        for i, (r, tq) in enumerate(zip(reqs, query_lens)):
            q = query[start: start + tq]
            got = output[start: start + tq]
            start += tq
            if tq == 1:
                want = ref.sparse_paged_attention(q, k_cache, v_cache, 2 * bt[i: i + 1], sl[i: i + 1], k_min=k_min,
                                                  k_max=k_max, page_budget=2, gamma=DEFAULT_GAMMA)   # the plug-in's
            else:
                want = ref.paged_attention(q[None], k_cache, v_cache, 2 * bt[i: i + 1], sl[i: i + 1])
            torch.testing.assert_close(got, want.reshape(got.shape), atol=2e-5, rtol=1e-4)
        if pad_rows and not padded_graph:
            assert output[start:].isnan().all()          # left to vLLM, as before (never read)
        else:
            assert not output.isnan().any()
    if graphs:
        assert sorted(builder._graph_attention) == [1, 2, 4]


def test_backend_layer_call_makes_no_host_sync(vllm_config, monkeypatch):
    """TinyAttnImpl.do_kv_cache_update + forward (the per-layer calls vLLM makes, here on CPU tensors) read no tensor
    value on the host, for a mixed step and for a padded CUDA-graph decode batch; the builder does, once per step.
    Two layers per step: the first layer's forward unwatched (a plan may build per-step tables at its first run)."""
    from tinyattn.integrations.vllm.backend import TinyAttnImpl

    builder = make_builder(vllm_config, monkeypatch, graphs=True)
    impls = [TinyAttnImpl(num_heads=4, head_size=8, scale=8 ** -0.5, num_kv_heads=2) for _ in range(2)]
    layers = [type("Layer", (), {"layer_name": f"model.layers.{i}.self_attn.attn"})() for i in range(2)]
    torch.manual_seed(6)
    kvs = [vllm_cache(30, 2, 4, 8) for _ in range(2)]
    vl = FakeVllm(30, 4)
    vl.free.remove(0)
    for reqs, query_lens, pad_rows in (([0, 1, 2], [7, 5, 9], 0), ([0, 1, 2], [1, 1, 3], 2), ([0, 1, 2], [1, 1, 1], 1)):
        meta, slots = _step(builder, reqs, vl, query_lens, pad_rows)
        T = slots.shape[0]
        key, value, query = torch.randn(T, 2, 8), torch.randn(T, 2, 8), torch.randn(T, 4, 8)
        output = torch.zeros_like(query)
        for i, (impl, layer, kv) in enumerate(zip(impls, layers, kvs)):
            impl._pools(kv)                               # the views of vLLM's cache: made once, at the first call
            with no_host_sync(monkeypatch) as found:
                impl.do_kv_cache_update(layer, key, value, kv, slots)
            assert found == []
            with no_host_sync(monkeypatch) if i else contextlib.nullcontext([]) as found:
                impl.forward(layer, query, key, value, kv, meta, output)
            assert found == []
