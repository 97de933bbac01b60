"""Run vLLM's offline ``LLM`` once and write what it generated as JSON (the vLLM tests start it in a subprocess,
one engine per configuration, since ``TINYATTN_*`` settings are read when vLLM's processes start).

    python tests/vllm/run_llm.py CONFIG.json OUT.json

CONFIG: ``model`` (a directory), ``prompts`` (lists of token ids), ``max_tokens``, ``block_size``,
``prompt_logprobs`` (0 = none), ``llm`` (extra ``LLM`` keyword arguments), ``env`` (set before vLLM starts),
``alone`` (also generate each prompt on its own, in the same engine, after the batch).
OUT: ``tokens`` (per prompt), ``prompt_logprobs`` (per prompt, the logprob of each prompt token after the
first), ``alone_tokens``, ``impl`` (class name of layer 0's attention implementation).
"""

from __future__ import annotations

import json
import os
import sys


def main(config_path: str, out_path: str) -> None:
    cfg = json.load(open(config_path))
    os.environ.update(cfg.get("env", {}))
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")      # apply_model sends a function
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=cfg["model"], dtype="float32", block_size=cfg.get("block_size", 32), enforce_eager=True,
              skip_tokenizer_init=True, seed=0, **cfg.get("llm", {}))
    n_lp = cfg.get("prompt_logprobs", 0)
    params = SamplingParams(temperature=0.0, max_tokens=cfg["max_tokens"], ignore_eos=True, detokenize=False,
                            prompt_logprobs=n_lp or None)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in cfg["prompts"]]
    outs = llm.generate(prompts, params, use_tqdm=False)
    result = {"tokens": [list(o.outputs[0].token_ids) for o in outs]}
    if n_lp:
        lps = []
        for p, o in zip(cfg["prompts"], outs):
            lps.append([entry[tok].logprob for tok, entry in zip(p[1:], o.prompt_logprobs[1:])])
        result["prompt_logprobs"] = lps
    if cfg.get("alone"):
        result["alone_tokens"] = [list(llm.generate([pr], params, use_tqdm=False)[0].outputs[0].token_ids)
                                  for pr in prompts]
    try:
        result["impl"] = llm.apply_model(lambda model: type(model.model.layers[0].self_attn.attn.impl).__name__)[0]
    except Exception as e:  # noqa: BLE001 - informative only
        result["impl"] = f"unknown ({type(e).__name__}: {e})"
    json.dump(result, open(out_path, "w"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
