"""tinyattn.metrics: the DESIGN.md §1 bytes model and the selection-quality ratios, against values worked out by
hand, and the three places that report them (profiler, runtime stats, bench) agreeing with it."""

import importlib
import math
import sys
from pathlib import Path

import torch

import tinyattn
import tinyattn.profiler as tp
from tinyattn import metrics as M
from tinyattn.models import LlamaConfig, LlamaModel, LlamaRuntime
from tinyattn.models.llama import GenerationStats

BENCH = Path(__file__).resolve().parents[1] / "bench"


def test_design_card_example_is_an_eightfold_ideal_speedup():
    # DESIGN.md §1: L = 32768, S = 16, K·S = 2048 (K = 128 pages). Per KV head, D = 128, 2-byte elements:
    # dense = 2·32768·128·2 = 16 MiB; sparse = boxes 2·2048·128·2 (4 MiB / 8) + pages 2·2048·128·2 = 2 MiB
    assert M.dense_bytes(32768, 128, 2) == 16_777_216
    assert M.sparse_bytes(32768, 128, 16, 128, 2) == 1_048_576 + 1_048_576
    assert M.ideal_speedup(32768, 128, 16, 128) == 8.0
    assert M.pages_read(32768, 16, 128) == 128 and M.pages_read(32768, 16) == 2048


def test_small_cases_by_hand():
    # L = 10, S = 4 (3 pages, the last holds 2 tokens), D = 3, 4-byte elements
    assert M.num_pages(10, 4) == 3 and M.num_pages(0, 4) == 0 and M.num_pages(8, 4) == 2
    assert M.dense_bytes(10, 3, 4) == 2 * 10 * 3 * 4 == 240
    # budget 2 < 3 pages: boxes of 3 pages (2·3·3·4 = 72) + K/V of 2 full pages (2·8·3·4 = 192)
    assert M.sparse_bytes(10, 3, 4, 2, 4) == 264
    # fp32 boxes over a 2-byte cache: 2·3·3·4 + 2·8·3·2
    assert M.sparse_bytes(10, 3, 4, 2, 2, box_elem=4) == 72 + 96
    # a row that fits the budget is read whole, no box pass; so is a dense step (budget None)
    assert M.sparse_bytes(10, 3, 4, 3, 4) == M.sparse_bytes(10, 3, 4, None, 4) == 240
    assert M.pages_read(10, 4, 2) == 2 and M.pages_read(10, 4, 5) == 3 and M.pages_read(0, 4, 2) == 0
    assert M.io_bytes(2, 4, 3, 4) == 2 * 2 * 4 * 3 * 4
    assert M.ideal_speedup(10, 3, 4, 3) == 1.0


def test_tensor_inputs_match_int_inputs_elementwise():
    lens = torch.tensor([0, 1, 10, 16, 17, 100], dtype=torch.int32)
    for budget in (None, 1, 2, 5):
        got = M.sparse_bytes(lens, 8, 4, budget, 2, box_elem=4)
        assert got.tolist() == [M.sparse_bytes(int(n), 8, 4, budget, 2, box_elem=4) for n in lens]
        assert M.pages_read(lens, 4, budget).tolist() == [M.pages_read(int(n), 4, budget) for n in lens]
    assert M.dense_bytes(lens.long(), 8, 2).tolist() == [2 * int(n) * 8 * 2 for n in lens]


def test_selection_reads_count_valid_tokens_of_the_selected_pages():
    # row 0: 10 tokens in pages of 4 -> pages 0 (4 tokens), 1 (4), 2 (2); page 5 is past the end, -1 padding
    # row 1: 4 tokens -> one page
    idx = torch.tensor([[[0, 2, -1, 5], [1, 2, -1, -1]], [[0, -1, -1, -1], [0, 1, -1, -1]]], dtype=torch.int32)
    pages, tokens = M.selection_reads(idx, torch.tensor([10, 4]), 4)
    assert pages.tolist() == [[2, 2], [1, 1]]
    assert tokens.tolist() == [[6, 6], [4, 4]]


def test_selection_overlap_and_ratios():
    sel = torch.tensor([[[0, 2]]])
    orc = torch.tensor([[[1, 2]]])
    mass = torch.tensor([[[0.5, 0.2, 0.3]]])
    hit, n_oracle, captured = M.selection_overlap(sel, orc, mass)
    assert hit.tolist() == [[1.0]] and n_oracle.tolist() == [[2.0]]
    assert math.isclose(float(captured), 0.8, rel_tol=1e-6)
    assert M.hit_rate(1, 2) == 0.5 and M.captured_mass(1.6, 2) == 0.8
    assert math.isnan(M.hit_rate(0, 0)) and math.isnan(M.captured_mass(0.0, 0))
    from tinyattn import selection
    assert selection.selection_overlap is M.selection_overlap            # one definition


def _bench_common():
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    return importlib.import_module("common")        # as the bench scripts import it


def test_profiler_runtime_and_bench_report_the_same_bytes():
    B, L, S, K, Hq, Hkv, D = 2, 64, 16, 2, 4, 2, 8          # L a multiple of S: every selected page is full
    model_bytes = B * Hkv * M.sparse_bytes(L, D, S, K, 4)     # fp32 cache and boxes
    dense = B * Hkv * M.dense_bytes(L, D, 4)
    assert model_bytes == B * Hkv * (2 * (L // S) * D * 4 + 2 * K * S * D * 4)

    # bench/common.py: the same per-head figure plus queries and outputs
    C = _bench_common()
    io = M.io_bytes(B, Hq, D, 4)
    assert C.decode_bytes(batch=B, context=L, num_q_heads=Hq, num_kv_heads=Hkv, head_dim=D, page_size=S, elem=4,
                          budget_tokens=K * S) == model_bytes + io
    assert C.decode_bytes(batch=B, context=L, num_q_heads=Hq, num_kv_heads=Hkv, head_dim=D, page_size=S,
                          elem=4) == dense + io

    # the runtime's GenerationStats for one decode step of a one-layer sparse model
    cfg = LlamaConfig(dim=Hq * D, hidden_dim=8, n_layers=1, n_heads=Hq, n_kv_heads=Hkv, vocab_size=8)
    rt = LlamaRuntime(LlamaModel(cfg), page_size=S, page_budget=K)
    stats = GenerationStats()
    rt._count_reads(stats, torch.full((B,), L, dtype=torch.int32))
    assert stats.kv_bytes_read == model_bytes and stats.kv_bytes_dense == dense
    assert stats.pages_read == B * Hkv * K and stats.pages_dense == B * Hkv * (L // S)

    # the profiler, on an actual sparse call: attention span (K/V + queries/outputs) + score span (boxes + q)
    g = torch.Generator().manual_seed(0)
    num_pages = B * (L // S)
    k_cache = torch.randn(num_pages, S, Hkv, D, generator=g)
    v_cache = torch.randn(num_pages, S, Hkv, D, generator=g)
    table = torch.arange(num_pages, dtype=torch.int32).view(B, -1)
    lens = torch.full((B,), L, dtype=torch.int32)
    k_min = torch.empty(num_pages, Hkv, D)
    k_max = torch.empty(num_pages, Hkv, D)
    tinyattn.update_page_metadata(k_cache, table, lens, k_min, k_max, backend="torch")
    q = torch.randn(B, Hq, D, generator=g)
    with tp.profile(oracle=False) as prof:
        tinyattn.sparse_paged_attention(q, k_cache, v_cache, table, lens, k_min=k_min, k_max=k_max, page_budget=K,
                                        backend="torch")
    by_op = {r.op: r for r in prof.records}
    assert by_op["attention"].bytes - io == B * Hkv * M.kv_bytes(K * S, D, 4)
    assert by_op["score"].bytes - q.numel() * 4 == B * Hkv * M.box_bytes(L // S, D, 4)
    assert by_op["attention"].bytes - io + by_op["score"].bytes - q.numel() * 4 == model_bytes
    assert by_op["attention"].pages == stats.pages_read
