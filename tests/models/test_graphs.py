"""``cuda_graphs=True`` of the runtime and the engine (issue 26 item 1), on the CPU.

What a CPU can prove: the option falls back to eager steps (one warning) with the same greedy tokens; the decode
step's body, the part a CUDA graph captures (:meth:`tinyattn.models.graphs.DecodeGraphs.body`), run on the Triton
backend under the interpreter after a warm-up step, makes no host sync and no allocation from tinyattn's code
(the watcher of tests/host_calls.py) and equals the eager step of the torch backend; padding rows give
finite logits and change nothing in the real rows' logits, K/V or page boxes. The capture and replay themselves
need a GPU: tests/gpu/test_gpu_graphs.py.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from tinyattn.engine import Engine, SamplingParams
from tinyattn.layer import PagedAttention
from tinyattn.models import LlamaRuntime, SparsityConfig
from tinyattn.models import graphs as graphs_module
from tinyattn.models.graphs import DecodeGraphs, batch_buckets

from paths import KNOWN_GOOD
from model_fixtures import model, tok  # noqa: F401  (fixtures)
from host_calls import watch_host_calls

TORCH = "torch"      # conftest sets TRITON_INTERPRET=1: backend=None would pick the slow interpreter


def test_batch_buckets_are_powers_of_two_then_the_max():
    assert batch_buckets(1) == [1]
    assert batch_buckets(8) == [1, 2, 4, 8]
    assert batch_buckets(6) == [1, 2, 4, 6]
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="max_batch"):
            batch_buckets(bad)


def test_runtime_on_cpu_falls_back_with_one_warning_and_the_known_good_text(model, tok):
    """On a CPU the option warns once (at construction, naming the reason) and generate() runs eager steps: the
    README's greedy text, token for token the runtime without the option."""
    with pytest.warns(UserWarning, match="cuda_graphs=True: the model is on cpu") as record:
        rt = LlamaRuntime(model, page_size=16, page_budget=64, backend=TORCH, cuda_graphs=True)
    assert len(record) == 1
    assert rt.graphs_off is not None
    with warnings.catch_warnings(record=True) as later:
        warnings.simplefilter("always")
        out = rt.generate([[tok.bos_id]], max_new_tokens=60)
    assert not [w for w in later if "cuda_graphs" in str(w.message)]       # no second warning from generate
    plain = LlamaRuntime(model, page_size=16, page_budget=64, backend=TORCH).generate([[tok.bos_id]],
                                                                                      max_new_tokens=60)
    assert out.tokens == plain.tokens
    assert out.stats.graphed_steps == 0
    assert KNOWN_GOOD.read_text(encoding="utf-8")[:-1].startswith(tok.decode([tok.bos_id] + out.tokens[0]))


def test_engine_on_cpu_falls_back_with_one_warning(model, tok):
    prompts = [tok.encode(t, bos=True) for t in ("Once upon a time", "Tom had a red ball")]
    params = SamplingParams(max_new_tokens=12)
    with pytest.warns(UserWarning, match="cuda_graphs=True: the model is on cpu") as record:
        engine = Engine(model, page_size=16, num_pages=8, page_budget=2, backend=TORCH, cuda_graphs=True)
    assert len(record) == 1
    assert engine.cache.num_pages == 8 and engine.runner.graphs is None      # no padding page off CUDA
    plain = Engine(model, page_size=16, num_pages=8, page_budget=2, backend=TORCH)
    assert engine.generate(prompts, params) == plain.generate(prompts, params)


@pytest.mark.parametrize("kwargs, reason", [
    (dict(backend="torch"), "torch backend"),
    (dict(kv_cache_dtype="int8"), "kv_cache_dtype='int8'"),
    (dict(policy="h2o"), "policy 'h2o'"),
    (dict(selection_metrics=True), "selection metrics"),
])
def test_why_not_graphed_names_each_static_reason(model, kwargs, reason, monkeypatch):
    """Past the device check (patched as if on CUDA), each setup that cannot be captured is named."""
    monkeypatch.setattr(type(model), "device", property(lambda self: torch.device("cuda")))
    monkeypatch.setattr(graphs_module, "resolve_backend", lambda backend, device: backend or "triton")
    sparsity = SparsityConfig(page_budget=4, policy=kwargs.pop("policy", "quest"))
    assert reason in graphs_module.why_not_graphed(model, sparsity, **kwargs)
    assert graphs_module.why_not_graphed(model, SparsityConfig(page_budget=4)) is None


# ---------------------------------------------------------------- the captured body, Triton backend (interpreter)
PAGE_SIZE, BUDGET, MAX_PAGES = 4, 3, 8
TEXTS = ("Once upon a time, there was a dog.", "Tom had a red ball", "The sun was hot")


def _prefilled(model, tok, sparsity):
    """A cache with the prompts prefilled densely (torch backend); their ids and each row's greedy next token."""
    prompts = [tok.encode(t, bos=True) for t in TEXTS]
    cache = model.new_cache(page_size=PAGE_SIZE, num_pages=24)
    ids = [cache.add_sequence() for _ in prompts]
    attention = PagedAttention(sparsity, backend=TORCH)
    first = [int(model(torch.tensor([p]), cache, [sid], attention=attention, last_only=True)[0].argmax())
             for sid, p in zip(ids, prompts)]
    assert max(-(-(len(p) + 2) // PAGE_SIZE) for p in prompts) > BUDGET        # the rows really select
    return cache, ids, first


def _row_pages(cache, ids):
    return sorted(p for s in ids for p in cache.pages(s))


@pytest.mark.slow
def test_graph_body_makes_no_sync_no_allocation_and_padding_changes_nothing(model, tok, monkeypatch):
    """Three rows in bucket 4 (one padding row), Triton backend under the interpreter, graph-mode plan. After a
    warm-up step, the body of a later step (what a CUDA graph captures) calls no host-sync method and no tensor
    factory from tinyattn's code. Every step's real rows equal the eager step of the torch backend on a twin cache
    without padding (same tokens; logits within fp32 noise); the padding row's logits are finite and its attention
    zeros; the real rows' K/V and boxes equal the twin's, so the padding wrote only into its scratch page."""
    sparsity = SparsityConfig(page_budget=BUDGET)
    cache, ids, tokens = _prefilled(model, tok, sparsity)
    twin, twin_ids, _ = _prefilled(model, tok, sparsity)
    graphs = DecodeGraphs(model, cache, sparsity, backend="triton", max_batch=4, max_pages_per_seq=MAX_PAGES,
                          capture=False)
    assert graphs.bucket(len(ids)) == 4 and not graphs.capture
    eager = PagedAttention(sparsity, backend=TORCH)
    twin.add_sequence()                                        # the same page ids on both caches
    twin.extend([twin.sequences[-1]], 1)
    for step in range(2):
        if step == 0:
            got = graphs.step(ids, tokens)                     # warm-up: compiles / first plan at capacity
        else:
            b = graphs.prepare(ids, tokens)
            seen = []
            watch_host_calls(monkeypatch, seen)
            try:
                full = graphs.body(b)
            finally:
                monkeypatch.undo()
            assert seen == [], f"the body called {seen} from tinyattn code"
            assert full.shape == (4, model.config.vocab_size)
            assert torch.isfinite(full[3]).all()                              # the padding row
            assert torch.equal(graphs._attn_out[3], torch.zeros_like(graphs._attn_out[3]))
            got = full[:3]
        want = model(torch.tensor(tokens)[:, None], twin, twin_ids, sparse=True, attention=eager, last_only=True)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
        assert got.argmax(-1).tolist() == want.argmax(-1).tolist()
        tokens = want.argmax(-1).tolist()
    pages = _row_pages(cache, ids)
    assert pages == _row_pages(twin, twin_ids) and graphs._pad_slot // PAGE_SIZE not in pages
    for li in range(model.config.n_layers):
        for name in ("k_cache", "v_cache", "k_min", "k_max"):
            torch.testing.assert_close(getattr(cache, name)[li][pages], getattr(twin, name)[li][pages],
                                       atol=1e-5, rtol=1e-5)


def test_prepare_refuses_a_row_wider_than_the_capacity(model, tok):
    sparsity = SparsityConfig(page_budget=BUDGET)
    cache, ids, tokens = _prefilled(model, tok, sparsity)
    graphs = DecodeGraphs(model, cache, sparsity, backend="triton", max_batch=4, max_pages_per_seq=2, capture=False)
    before = [cache.length(s) for s in ids]
    with pytest.raises(ValueError, match="max_pages_per_seq=2"):
        graphs.prepare(ids, tokens)
    assert [cache.length(s) for s in ids] == before                          # nothing extended
    with pytest.raises(ValueError, match="max_batch=4"):
        graphs.bucket(5)
    assert graphs.can_replay(4) and not graphs.can_replay(5) and not graphs.can_replay(0)


def _graphable_on_cpu(monkeypatch):
    """Pretend the setup can be captured: the runtime / engine then route decode steps through DecodeGraphs,
    which on a CPU runs its body eagerly (capture=False by device) with the same buffers and calls."""
    monkeypatch.setattr(graphs_module, "why_not_graphed", lambda *a, **k: None)


@pytest.mark.slow
def test_engine_routes_decode_through_the_graph_body_across_buckets(model, tok, monkeypatch):
    """Engine(cuda_graphs=True) with three requests of different lengths: the decode batch shrinks 3 -> 2 -> 1
    (buckets 4, 2, 1), every decode forward goes through DecodeGraphs (Triton interpreter), and the tokens and
    peak pages equal the eager engine's on the torch backend (the padding page is not counted)."""
    _graphable_on_cpu(monkeypatch)
    prompts = [tok.encode(t, bos=True) for t in TEXTS]
    params = [SamplingParams(max_new_tokens=n) for n in (2, 3, 5)]
    kw = dict(page_size=PAGE_SIZE, num_pages=16, page_budget=BUDGET, max_num_seqs=4)
    engine = Engine(model, backend="triton", cuda_graphs=True, **kw)
    graphs = engine.runner.graphs
    assert graphs is not None and graphs.buckets == [1, 2, 4] and engine.cache.num_pages == 17
    plain = Engine(model, backend=TORCH, **kw)
    assert engine.generate(prompts, params) == plain.generate(prompts, params)
    assert graphs.steps == sum(b > 0 for b in engine.stats.decode_batch_sizes) == 4
    assert engine.stats.peak_pages == plain.stats.peak_pages


@pytest.mark.slow
@pytest.mark.parametrize("selection", [{}, dict(gamma=0.25, top_p=0.9, rerank="int4")], ids=["quest", "rerank-top-p"])
def test_runtime_routes_decode_through_the_graph_body(model, tok, monkeypatch, selection):
    """The graphed route (body run eagerly, Triton under the interpreter) gives the torch runtime's tokens; with
    rerank='int4' the body hands each layer its key codes (a cache with key_codes=True)."""
    _graphable_on_cpu(monkeypatch)
    prompts = [tok.encode(t, bos=True) for t in TEXTS[1:]]
    kw = dict(page_size=PAGE_SIZE, page_budget=BUDGET, **selection)
    rt = LlamaRuntime(model, backend="triton", cuda_graphs=True, **kw)
    seen = []
    real = DecodeGraphs.step
    monkeypatch.setattr(DecodeGraphs, "step", lambda self, *a: (seen.append(len(a[0])), real(self, *a))[1])
    out = rt.generate(prompts, max_new_tokens=4, eos_id=None)
    assert seen == [2, 2, 2]
    assert out.tokens == LlamaRuntime(model, backend=TORCH, **kw).generate(prompts, max_new_tokens=4,
                                                                         eos_id=None).tokens
