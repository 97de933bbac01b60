"""tinyattn.profiler: spans per layer and op, pages / bytes, oracle hit rate and captured mass, traces."""

import json

import pytest
import torch

import tinyattn
import tinyattn.profiler as tp
from tinyattn.ops import spans

from paged_problems import make_problem


def _problem(seed=0, lens=(70, 33), page_size=8, hkv=2, group=2, head_dim=16):
    p = make_problem(seed, batch=len(lens), seq_lens=list(lens), page_size=page_size, num_kv_heads=hkv, group=group,
                     head_dim=head_dim)
    k_min, k_max = p.bounds()
    return p, k_min, k_max


def _sparse(p, k_min, k_max, budget):
    return tinyattn.sparse_paged_attention(p.q[:, 0], p.k_cache, p.v_cache, p.block_table, p.seq_lens,
                                           k_min=k_min, k_max=k_max, page_budget=budget, backend="torch")


def test_no_profiler_spans_are_a_shared_null_context():
    assert spans.recorder is None
    assert spans.span("score", q=None) is spans.span("attention") is tp.layer(3)


def test_records_each_phase_per_layer_with_times_pages_and_bytes():
    p, k_min, k_max = _problem()
    with tp.profile(oracle=False) as prof:
        for li in range(2):
            with tp.layer(li):
                _sparse(p, k_min, k_max, budget=3)
        tinyattn.paged_attention(p.q[:, 0], p.k_cache, p.v_cache, p.block_table, p.seq_lens, backend="torch")
    assert spans.recorder is None
    ops = [(r.layer, r.op) for r in prof.records]
    assert ops == [(0, "score"), (0, "topk"), (0, "attention"), (1, "score"), (1, "topk"), (1, "attention"),
                   (-1, "attention")]
    assert all(r.duration_us > 0 for r in prof.records)
    starts = [r.start_us for r in prof.records]
    assert starts == sorted(starts)
    S, Hkv, D = 8, 2, 16
    # scoring reads the two boxes of every valid page of every row, per KV head (+ the queries)
    score = prof.records[0]
    assert score.pages == (9 + 5) * Hkv
    assert score.bytes == 2 * (9 + 5) * Hkv * D * 4 + p.q.numel() * 4
    # sparse attention reads K and V of the valid tokens of the 3 pages selected per (row, KV head)
    att = prof.records[2]
    assert att.sparse and att.pages == 3 * Hkv * 2
    q_io = 2 * p.q.numel() * 4
    sel = tinyattn.select_pages(
        tinyattn.page_scores(p.q[:, 0], k_min, k_max, p.block_table, p.seq_lens, page_size=S, backend="torch"),
        p.seq_lens, page_size=S, page_budget=3, backend="torch").long()
    tok = torch.clamp(p.seq_lens.long()[:, None, None] - sel * S, 0, S)
    tokens = int(tok.sum())
    assert att.bytes == 2 * tokens * D * 4 + q_io
    dense = prof.records[-1]
    assert not dense.sparse and dense.pages == (9 + 5) * Hkv
    assert dense.bytes == 2 * (70 + 33) * Hkv * D * 4 + q_io
    rows = prof.table()
    assert {(r["layer"], r["op"]) for r in rows} == set(ops)
    shares = [r["share"] for r in rows if r["layer"] == 0]
    assert abs(sum(shares) - 1) < 1e-9


def test_metadata_span_counts_the_keys_read():
    p, k_min, k_max = _problem()
    with tp.profile() as prof:
        tinyattn.update_page_metadata(p.k_cache, p.block_table, p.seq_lens, k_min, k_max, backend="torch")
    (r,) = prof.records
    assert r.op == "metadata" and r.pages == (9 + 5) * 2 and r.bytes == (70 + 33) * 2 * 16 * 4


def test_oracle_hit_rate_and_captured_mass():
    """One page holds almost all the attention mass: a selection with it captures ~all of it, one without doesn't.

    The oracle is the selection module's: the forced pages (the last page; the first ``num_sink_pages``)
    and then the pages of most true attention mass, ``page_budget`` pages in all.
    """
    p, _, _ = _problem(lens=(64,), hkv=1, group=2)
    q = p.q                                                            # [1, 1, 2, 16]
    hot = 3                                                            # logical page 3 gets keys aligned with q
    phys = int(p.block_table[0, hot])
    p.k_cache[phys, :, 0] = 8.0 * q[0, 0].sum(0) / q[0, 0].sum(0).norm()
    # budget 2 of 8 pages: the oracle keeps the forced last page (7) and the hot page, so [hot, 7] hits both
    hits, oracle_pages, mass, n = tp.oracle_quality(q, p.k_cache, p.block_table, p.seq_lens,
                                                    torch.tensor([[[hot, 7]]]), scale=1.0)
    assert (hits, oracle_pages, n) == (2, 2, 1) and mass > 0.99
    hits, oracle_pages, mass, _ = tp.oracle_quality(q, p.k_cache, p.block_table, p.seq_lens,
                                                    torch.tensor([[[0, 1]]]), scale=1.0)
    assert hits == 0 and oracle_pages == 2 and mass < 0.01
    # with a sink page forced too, budget 3: the oracle is {0, hot, 7}
    hits, oracle_pages, mass, _ = tp.oracle_quality(q, p.k_cache, p.block_table, p.seq_lens,
                                                    torch.tensor([[[0, hot, 7]]]), scale=1.0, num_sink_pages=1)
    assert (hits, oracle_pages) == (3, 3) and mass > 0.99
    hits, oracle_pages, _, _ = tp.oracle_quality(q, p.k_cache, p.block_table, p.seq_lens,
                                                 torch.tensor([[[hot, 6, 7]]]), scale=1.0, num_sink_pages=1)
    assert (hits, oracle_pages) == (2, 3)                              # page 0 (forced) missed
    # a budget that holds the whole row: not a sparse row, nothing counted
    all_pages = torch.tensor([[[0, 1, 2, 3, 4, 5, 6, 7, -1]]])
    assert tp.oracle_quality(q, p.k_cache, p.block_table, p.seq_lens, all_pages, scale=0.25) == (0, 0, 0.0, 0)


def test_profiler_quality_is_the_selection_modules_with_the_callers_forced_pages():
    """Hit rate / captured mass of the fused op and of ``selection.attend`` under sink + recent pages, checked
    against a dense softmax and a forced-pages-then-top-mass oracle computed here."""
    from tinyattn import selection

    p, k_min, k_max = _problem(lens=(120, 90), page_size=4)
    budget, sinks, recent, S = 6, 1, 2, 4
    q = p.q[:, 0]                                                      # [B, Hq, D]
    with tp.profile() as prof:
        with tp.layer(0):
            tinyattn.sparse_paged_attention(q, p.k_cache, p.v_cache, p.block_table, p.seq_lens, k_min=k_min,
                                            k_max=k_max, page_budget=budget, num_sink_pages=sinks,
                                            num_recent_pages=recent, backend="torch")
        with tp.layer(1):
            ctx = selection.SelectionContext(layer=1, q=q, k_cache=p.k_cache, v_cache=p.v_cache, k_min=k_min,
                                             k_max=k_max, block_table=p.block_table, seq_lens=p.seq_lens,
                                             page_budget=budget, num_sink_pages=sinks, num_recent_pages=recent,
                                             backend="torch")
            selection.attend(selection.QuestPolicy(), ctx)
    # independent reference: dense softmax per query head, page mass summed over the group, normalised
    sel = tinyattn.select_pages(
        tinyattn.page_scores(q, k_min, k_max, p.block_table, p.seq_lens, page_size=S, backend="torch"),
        p.seq_lens, page_size=S, page_budget=budget, num_sink_pages=sinks, num_recent_pages=recent,
        backend="torch").long()
    Hkv, G = 2, 2
    hits = pages = 0
    masses = []
    for b, L in enumerate(p.seq_lens.tolist()):
        n = -(-L // S)
        keys = torch.stack([p.k_cache[int(p.block_table[b, j])] for j in range(n)]).reshape(n * S, Hkv, -1)[:L]
        for h in range(Hkv):
            logits = q[b, h * G:(h + 1) * G].double() @ keys[:, h].double().T * q.shape[-1] ** -0.5
            prob = torch.softmax(logits, -1).sum(0) / G                # [L]
            mass = torch.zeros(n * S, dtype=torch.float64)
            mass[:L] = prob
            mass = mass.view(n, S).sum(-1)                             # [n]
            forced = set(range(n - recent, n)) | set(range(sinks))
            rest = sorted((j for j in range(n) if j not in forced), key=lambda j: (-float(mass[j]), j))
            oracle = forced | set(rest[:budget - len(forced)])
            chosen = {int(j) for j in sel[b, h] if j >= 0}
            hits += len(chosen & oracle)
            pages += len(oracle)
            masses.append(float(mass[sorted(chosen)].sum()))
    assert [r.op for r in prof.records if r.layer == 0] == ["score", "topk", "attention"]   # oracle not recorded
    for lay in (0, 1):
        qual = prof.quality[lay]
        assert qual.pages_selected == pages == budget * Hkv * 2 and qual.pages_hit == hits
        assert qual.captured_mass == pytest.approx(sum(masses) / len(masses), abs=1e-5)


def test_profile_reports_quality_per_layer_and_summary_text(tmp_path):
    p, k_min, k_max = _problem(lens=(120, 90), page_size=4)
    with tp.profile(trace=tmp_path / "trace.json") as prof:
        for li in range(3):
            with tp.layer(li):
                _sparse(p, k_min, k_max, budget=6)
    assert set(prof.quality) == {0, 1, 2}
    for q in prof.quality.values():
        assert 0.0 <= q.hit_rate <= 1.0 and 0.0 < q.captured_mass <= 1.0 + 1e-6
        assert q.pages_selected == 6 * 2 * 2
    att = [r for r in prof.records if r.op == "attention"]
    assert all(r.hit_rate is not None and r.captured_mass is not None for r in att)
    text = prof.summary()
    for word in ("score", "topk", "attention", "hit rate", "captured mass", "GB/s"):
        assert word in text
    trace = json.loads((tmp_path / "trace.json").read_text())
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(events) == len(prof.records)
    assert {e["tid"] for e in events} == {1, 2, 3}
    assert all(e["dur"] > 0 and "pages" in e["args"] for e in events)


def test_a_selection_holding_the_whole_row_is_not_sparse():
    p, k_min, k_max = _problem(lens=(20, 9))
    with tp.profile() as prof:
        _sparse(p, k_min, k_max, budget=8)
    assert not prof.quality
    assert not any(r.sparse for r in prof.records)
    assert "trivially" in prof.summary()


def test_torch_profiler_trace_holds_the_spans(tmp_path):
    p, k_min, k_max = _problem()
    with tp.profile(torch_profiler=True, oracle=False) as prof:
        with tp.layer(5):
            _sparse(p, k_min, k_max, budget=3)
    path = tmp_path / "t.json"
    prof.export_chrome_trace(path)
    names = {e.get("name") for e in json.loads(path.read_text())["traceEvents"]}
    assert {"tinyattn.score[L5]", "tinyattn.topk[L5]", "tinyattn.attention[L5]"} <= names


def test_profiles_do_not_nest_and_the_hook_is_removed_on_error():
    with tp.profile():
        with pytest.raises(RuntimeError, match="already active"):
            with tp.profile():
                pass
    assert spans.recorder is None
    with pytest.raises(ZeroDivisionError):
        with tp.profile():
            1 / 0
    assert spans.recorder is None


def test_a_failing_count_never_breaks_the_profiled_run():
    with tp.profile() as prof:
        with spans.span("attention", q="not a tensor"):
            pass
    assert prof.error and len(prof.records) == 1
    assert "profiler error" in prof.summary()


def test_cli_profile_prints_the_summary_and_writes_the_trace(tmp_path, capsys):
    import argparse

    parser = argparse.ArgumentParser()
    tp.add_cli_option(parser)
    assert parser.parse_args([]).profile is None and parser.parse_args(["--profile"]).profile == ""
    with tp.cli_profile(None) as prof:
        assert prof is None
    p, k_min, k_max = _problem()
    trace = tmp_path / "cli.json"
    with tp.cli_profile(str(trace)) as prof:
        _sparse(p, k_min, k_max, budget=3)
    tp.print_cli_report(prof, str(trace))
    tp.print_cli_report(None, None)
    out = capsys.readouterr().out
    assert "--- profile" in out and "attention" in out and str(trace) in out
    assert json.loads(trace.read_text())["traceEvents"]


def test_profiler_counts_the_pages_of_the_window():
    """A windowed dense call reads the pages from the one holding the window's first key: lens 70 and 33, pages of
    8, window_left 20 -> first keys 49 and 12 -> pages 6..8 (3) and 1..4 (4), 2 KV heads."""
    import tinyattn.profiler as tp

    p = make_problem(0, batch=2, seq_lens=[70, 33], page_size=8, num_kv_heads=2, group=2, head_dim=16)
    with tp.profile(oracle=False) as prof:
        tinyattn.paged_attention(p.q[:, 0], *p.args[1:], window_left=20, backend="torch")
        tinyattn.paged_attention(p.q[:, 0], *p.args[1:], backend="torch")
    windowed, full = prof.records
    assert windowed.pages == (3 + 4) * 2 and full.pages == (9 + 5) * 2
    assert windowed.bytes < full.bytes
