"""Run vLLM's offline ``LLM`` for a list of configurations, one engine after the other, and write what each
generated as JSON. The vLLM tests start it in a subprocess: the ``TINYATTN_*`` settings are read when vLLM
starts its engine processes, so each configuration sets its environment before its ``LLM`` is made.

    python tests/vllm_backend/run_llm.py RUNS.json OUT.json

RUNS: a list of dicts with ``model`` (a directory), ``prompts`` (lists of token ids), ``max_tokens``,
``block_size`` (default 32), ``prompt_logprobs`` (0 = none), ``llm`` (extra ``LLM`` keyword arguments),
``env`` (set before the engine starts; the previous run's variables are removed), ``alone`` (also generate
each prompt on its own, in the same engine, after the batch).
OUT: per run ``tokens`` (per prompt), ``prompt_logprobs`` (per prompt: the logprob of each prompt token after
the first), ``alone_tokens`` (and ``alone_cached_tokens``, the prompt tokens vLLM's prefix cache
served), ``preemptions`` (vLLM's per-request count, summed; with
``llm={"disable_log_stats": False}``), ``seconds`` (engine start + generation), or ``error`` (the exception's text).
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time


def run_one(cfg: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    llm = LLM(model=cfg["model"], dtype="float32", block_size=cfg.get("block_size", 32), enforce_eager=True,
              skip_tokenizer_init=True, seed=0, **cfg.get("llm", {}))
    try:
        n_lp = cfg.get("prompt_logprobs", 0)
        params = SamplingParams(temperature=0.0, max_tokens=cfg["max_tokens"], ignore_eos=True, detokenize=False,
                                prompt_logprobs=n_lp or None)
        prompts = [TokensPrompt(prompt_token_ids=p) for p in cfg["prompts"]]
        outs = llm.generate(prompts, params, use_tqdm=False)
        result = {"tokens": [list(o.outputs[0].token_ids) for o in outs],
                  "preemptions": sum(o.metrics.num_preemptions for o in outs if o.metrics is not None)}
        if n_lp:
            result["prompt_logprobs"] = [[entry[tok].logprob for tok, entry in zip(p[1:], o.prompt_logprobs[1:])]
                                         for p, o in zip(cfg["prompts"], outs)]
        if cfg.get("alone"):
            # no prompt logprobs here: vLLM does not read its prefix cache for requests that ask for them
            alone_params = SamplingParams(temperature=0.0, max_tokens=cfg["max_tokens"], ignore_eos=True,
                                          detokenize=False)
            alone = [llm.generate([pr], alone_params, use_tqdm=False)[0] for pr in prompts]
            result["alone_tokens"] = [list(o.outputs[0].token_ids) for o in alone]
            result["alone_cached_tokens"] = [o.num_cached_tokens or 0 for o in alone]   # prefix-cache hits
        result["seconds"] = time.perf_counter() - t0
        return result
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def main(runs_path: str, out_path: str) -> None:
    runs = json.load(open(runs_path))
    base_env = dict(os.environ)
    results = []
    for cfg in runs:
        os.environ.clear()
        os.environ.update(base_env)
        os.environ.update(cfg.get("env", {}))
        try:
            results.append(run_one(cfg))
        except Exception as e:  # noqa: BLE001 - reported to the test
            results.append({"error": f"{type(e).__name__}: {e}"})
        json.dump(results, open(out_path, "w"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
