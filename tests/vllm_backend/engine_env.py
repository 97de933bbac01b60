"""The environment of a vLLM engine subprocess (tests/vllm_backend/): the caller's environment without tinyattn's
settings and the Triton interpreter (each run sets its own ``TINYATTN_*``), one BLAS thread, 1 GiB of KV cache, and
vLLM's CPU worker bound to core 0."""

import os


def engine_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TINYATTN_") and k != "TRITON_INTERPRET"}
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0")
    env.update(extra)
    return env
