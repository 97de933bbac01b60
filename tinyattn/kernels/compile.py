"""Compile the kernel specialisations the ops really launch, for a real GPU target, without a GPU.

The interpreter checks numerics but accepts code that the GPU compiler rejects (``tl.dot`` with a
dimension < 16, unsupported casts, shared-memory overflow, ...). This module runs the full Triton
pipeline down to cubin (ptxas ships in the triton wheel) for ``sm_80`` / ``sm_90``.

What it compiles is **what runs**: :mod:`tinyattn.kernels.launches` records the launches the ops make (under the
interpreter, kernels not executed) for a table of shapes covering the runtime's models, the benchmarks and the vLLM
backend, and each recorded launch is replayed through Triton's own JIT specialisation (the binder a GPU launch
uses: ints equal to 1 become constexprs, ints and pointers divisible by 16 get ``tt.divisibility``, the launcher's
constexprs and ``num_warps``) before it is compiled. Identical binaries are compiled once, named by the first
shape row that launched them. The training backward kernels, which no inference step launches, come from the
launchers' block heuristics (``*_blocks``) with plain ``i32`` signatures.

    python -m tinyattn.kernels.compile --arch 80 --arch 90 [--full] [--cross] [--list]

Must run with ``TRITON_INTERPRET`` unset (triton reads it at import; the recording runs in a subprocess with it
set). Default: the rows of :data:`tinyattn.kernels.launches.SHAPES` marked ``default`` (stories260K,
SmolLM2-135M, the 32K benchmark, the vLLM backend with bf16 and fp8 KV) plus the backward kernels, a few minutes
for two archs on 2 cores; ``--full`` every row; ``--cross`` the old cross product of dtypes, head dims and page
sizes from the heuristics (several hundred kernels; run it on a big machine). Each kernel's line ends with its
registers per thread, spill stores / loads (bytes, ``ptxas -v``) and shared memory (bytes), e.g.
``ok regs=162 spills=0/0 smem=256``; ``--table`` prints them as a Markdown table per arch.
"""
import argparse
import importlib
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Dict, Iterator, List, NamedTuple

import torch
import triton
from triton.backends.compiler import GPUTarget

from . import attention, attention_bwd, chunk_topk, kv_write, metadata, scoring, topk

DTYPES = {"fp16": "fp16", "bf16": "bf16", "fp32": "fp32"}
HEAD_DIMS = (8, 40, 64, 80, 128, 256)  # padded: 16, 64, 64, 128, 128, 256
PAGE_SIZES = (1, 16, 256)


class Spec(NamedTuple):
    name: str
    fn: object  # a JITFunction
    signature: Dict[str, str]
    constexprs: Dict[str, object]
    num_warps: int
    min_arch: int = 0  # below this SM version the specialisation is skipped (fp8 e4m3 needs sm_89)


def _signature(fn, pointers: Dict[str, str], floats=(), constexprs=()) -> Dict[str, str]:
    """Triton signature: given pointers, fp32 scalars, constexprs; every other argument is an i32."""
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in pointers:
            sig[name] = "*" + pointers[name]
        else:
            sig[name] = "fp32" if name in floats else "i32"
    return sig


def _spec(name, fn, pointers, meta, floats=()) -> Spec:
    meta = dict(meta)
    num_warps = meta.pop("num_warps", 4)
    return Spec(name, fn, _signature(fn, pointers, floats, meta), meta, num_warps)


def metadata_specs(dtype: str, bound_dtype: str, head_dim: int, page_size: int) -> Spec:
    """``dtype`` ``"i8"`` / ``"fp8e4nv"``: a quantized pool (``QUANT``, fp32 scales; fp8 from sm_89 on)."""
    meta = metadata.metadata_blocks(page_size, head_dim, max_pages=4096)
    meta["QUANT"] = dtype in ("i8", "fp8e4nv")
    ptrs = dict(k_cache=dtype, block_table="i32", seq_lens="i32", k_min=bound_dtype, k_max=bound_dtype,
                k_scale="fp32")
    spec = _spec(f"metadata[{dtype},{bound_dtype},D={head_dim},S={page_size}]", metadata.page_minmax_kernel,
                 ptrs, meta)
    return spec._replace(min_arch=89) if dtype == "fp8e4nv" else spec


def scoring_specs(dtype: str, bound_dtype: str, head_dim: int, page_size: int, tq: int, group: int) -> Spec:
    meta = scoring.score_blocks(tq, group, head_dim, page_size, max_pages=4096)
    ptrs = dict(q=dtype, k_min=bound_dtype, k_max=bound_dtype, block_table="i32", seq_lens="i32", out="fp32")
    return _spec(f"scores[{dtype},{bound_dtype},D={head_dim},S={page_size},Tq={tq},G={group}]",
                 scoring.page_scores_kernel, ptrs, meta, floats=("GAMMA",))


def topk_specs(max_pages: int, budget: int, page_size: int) -> Spec:
    meta = topk.topk_blocks(max_pages, budget, page_size)
    ptrs = dict(scores="fp32", seq_lens="i32", out="i32")
    return _spec(f"topk[P={max_pages},K={budget},S={page_size}]", topk.select_pages_kernel, ptrs, meta)


def top_p_specs(max_pages: int, budget: int, page_size: int) -> Spec:
    """The top-p filter of a capacity selection (``topk.top_p_filter_kernel``)."""
    meta = topk.top_p_blocks(max_pages, budget, page_size)
    ptrs = dict(scores="fp32", sel="i32", seq_lens="i32", out="i32")
    return _spec(f"top_p_filter[P={max_pages},K={budget},S={page_size}]", topk.top_p_filter_kernel, ptrs, meta,
                 floats=("TOP_P", "SCALE"))


def chunk_topk_specs(dtype: str, bound_dtype: str, head_dim: int, page_size: int, tq: int, group: int,
                     batch: int, num_kv_heads: int, max_pages: int, budget: int, top_p: bool = False) -> List[Spec]:
    """The two-stage selection (``chunk_topk``) as the plan launches it for these sizes: stage 1 and the merge
    (``top_p``: stage 1 also writes every valid page's score, ``SCORES``, and the filter follows)."""
    meta = chunk_topk.chunk_blocks(batch, num_kv_heads, max_pages, budget, tq, group, head_dim, page_size)
    tag = f"B={batch},Hkv={num_kv_heads},P={max_pages},K={budget}"
    ptrs = dict(q=dtype, k_min=bound_dtype, k_max=bound_dtype, block_table="i32", seq_lens="i32", ws_key="i32",
                ws_page="i32", scores="fp32")
    one = _spec(f"chunk_topk[{dtype},{bound_dtype},D={head_dim},S={page_size},Tq={tq},G={group},{tag},"
                f"chunk={meta['stage1']['CHUNK']}{',scores' if top_p else ''}]", chunk_topk.score_chunk_topk_kernel,
                ptrs, dict(meta["stage1"], SCORES=top_p), floats=("GAMMA",))
    ptrs = dict(ws_key="i32", ws_page="i32", seq_lens="i32", out="i32")
    two = _spec(f"merge_chunks[S={page_size},{tag},cand={meta['NC'] * meta['KC']}]",
                chunk_topk.merge_chunks_kernel, ptrs, meta["stage2"])
    return [one, two] + ([top_p_specs(max_pages, budget, page_size)] if top_p else [])


def attention_specs(dtype: str, head_dim: int, page_size: int, tq: int, group: int, sparse: bool,
                    split: bool, kv: str = "") -> Spec:
    """``kv``: the pool's Triton type when quantized (``"i8"``, ``"fp8e4nv"``: ``kv_cache_dtype`` int8 / fp8_e4m3,
    dequantized in registers with fp32 scales); empty for a pool of ``dtype``."""
    meta = attention.attention_blocks(tq, group, head_dim, page_size)
    meta.update(SPARSE=sparse, SPLIT=split, UPCAST=False, PRECISION="ieee", QUANT=bool(kv))
    ptrs = dict(q=dtype, k_cache=kv or dtype, v_cache=kv or dtype, block_table="i32", seq_lens="i32",
                page_indices="i32", k_scale="fp32", v_scale="fp32", out=dtype, lse="fp32", ws_o="fp32",
                ws_lse="fp32")
    name = (f"attention[{dtype}{',kv=' + kv if kv else ''},D={head_dim},S={page_size},Tq={tq},G={group},"
            f"{'sparse' if sparse else 'dense'}{',split' if split else ''}]")
    spec = _spec(name, attention.attn_fwd_kernel, ptrs, meta, floats=("qk_scale",))
    return spec._replace(min_arch=89) if kv == "fp8e4nv" else spec


def merge_specs(dtype: str, num_heads: int, num_splits: int, head_dim: int) -> Spec:
    meta = attention.merge_blocks(num_heads, num_splits, head_dim)
    ptrs = dict(ws_o="fp32", ws_lse="fp32", out=dtype, lse="fp32")
    return _spec(f"merge[{dtype},H={num_heads},splits={num_splits},D={head_dim}]",
                 attention.merge_splits_kernel, ptrs, meta)


def backward_specs(dtype: str, head_dim: int, page_size: int, tq: int, group: int, sparse: bool,
                   has_dlse: bool) -> Spec:
    """The backward kernel uses the forward's block sizes (same page walk); dk/dv are fp32 accumulators."""
    meta = attention.attention_blocks(tq, group, head_dim, page_size)
    meta.update(SPARSE=sparse, HAS_DLSE=has_dlse, UPCAST=False, PRECISION="ieee")
    ptrs = dict(q=dtype, k_cache=dtype, v_cache=dtype, block_table="i32", seq_lens="i32", page_indices="i32",
                out=dtype, dout=dtype, lse="fp32", dlse="fp32", dq=dtype, dk="fp32", dv="fp32")
    name = (f"attention_bwd[{dtype},D={head_dim},S={page_size},Tq={tq},G={group},"
            f"{'sparse' if sparse else 'dense'}{',dlse' if has_dlse else ''}]")
    return _spec(name, attention_bwd.attn_bwd_kernel, ptrs, meta, floats=("scale", "qk_scale"))


def kv_write_specs(pool: str, box: str, head_dim: int, page_size: int, k_dtype: str = "bf16") -> Spec:
    """The fused KV write (``pool``: ``fp32`` / ``fp16`` / ``bf16`` / ``i8`` / ``fp8e4nv``; ``box``: the boxes'
    type, empty for none)."""
    torch_types = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "i8": torch.int8,
                   "fp8e4nv": torch.float8_e4m3fn}
    meta = kv_write.kv_write_blocks(page_size, head_dim, torch_types[pool], torch_types[box] if box else None)
    ptrs = dict(k=k_dtype, v=k_dtype, slots="i64", k_cache=pool, v_cache=pool, k_min=box or pool,
                k_max=box or pool, k_scale="fp32", v_scale="fp32", fill="i64")
    spec = _spec(f"kv_write[{pool},box={box or 'none'},D={head_dim},S={page_size}]", kv_write.kv_write_kernel,
                 ptrs, meta)
    return spec._replace(min_arch=89) if pool == "fp8e4nv" else spec


def page_norm_specs(page_size: int, head_dim: int) -> Spec:
    meta = attention_bwd.page_norm_blocks(page_size, head_dim)
    ptrs = dict(dk="fp32", dv="fp32", norms="fp32")
    return _spec(f"page_grad_norm[D={head_dim},S={page_size}]", attention_bwd.page_grad_norm_kernel, ptrs, meta)


def representative() -> Iterator[Spec]:
    """Each dtype, padded head dims 16 / 128 / 256, page sizes 1 / 16 / 256, each kernel mode, at least once."""
    for dtype in DTYPES:
        yield attention_specs(dtype, 128, 16, 1, 4, sparse=False, split=False)
    yield attention_specs("fp16", 8, 16, 1, 4, sparse=False, split=False)  # BD = 16: smallest tl.dot
    yield attention_specs("bf16", 256, 256, 1, 3, sparse=True, split=False)  # BLOCK_N = 32 < page size
    yield attention_specs("fp16", 64, 1, 1, 8, sparse=True, split=True)  # 64 pages per iteration
    yield attention_specs("fp16", 128, 16, 512, 4, sparse=False, split=False)  # prefill: BLOCK_M = 64, 8 warps
    yield attention_specs("fp16", 128, 16, 1, 4, sparse=True, split=True, kv="i8")  # kv_cache_dtype int8
    yield attention_specs("bf16", 64, 16, 128, 4, sparse=False, split=False, kv="i8")  # int8 prefill
    yield attention_specs("bf16", 128, 16, 1, 4, sparse=False, split=False, kv="fp8e4nv")  # fp8_e4m3: sm_89+
    yield attention_specs("fp32", 8, 1, 1, 8, sparse=True, split=False, kv="fp8e4nv")
    yield merge_specs("fp16", 32, 16, 128)
    yield merge_specs("bf16", 3, 64, 80)
    yield metadata_specs("fp16", "fp16", 128, 16)
    yield metadata_specs("bf16", "fp32", 256, 256)
    yield metadata_specs("fp32", "fp32", 8, 1)
    yield metadata_specs("i8", "fp32", 128, 16)
    yield metadata_specs("fp8e4nv", "fp32", 64, 16)
    yield scoring_specs("fp16", "fp16", 128, 16, 1, 4)
    yield scoring_specs("bf16", "fp32", 256, 256, 64, 3)
    yield topk_specs(2048, 128, 16)
    yield topk_specs(8, 3, 1)
    # the two-stage selection at batch 1, 8 KV heads, budget 128 pages: 32K and 128K context at page 16
    yield from chunk_topk_specs("bf16", "bf16", 128, 16, 1, 4, 1, 8, 2048, 128)
    yield from chunk_topk_specs("bf16", "fp32", 128, 16, 1, 4, 1, 8, 8192, 128)
    yield from chunk_topk_specs("fp16", "fp16", 64, 1, 4, 3, 2, 2, 300, 5)      # argmax loops, Tq = 4, G = 3
    yield from chunk_topk_specs("bf16", "bf16", 128, 16, 1, 4, 1, 8, 2048, 128, top_p=True)   # top-p, 32K
    yield top_p_specs(128, 32, 16)                                           # top-p after the one-stage select
    yield from extra()
    yield kv_write_specs("bf16", "bf16", 128, 16)
    yield kv_write_specs("i8", "fp32", 64, 16)
    yield kv_write_specs("fp8e4nv", "bf16", 128, 32)


def extra() -> Iterator[Spec]:
    """Kernels no inference step launches (training backward), from the heuristics: not in the recorded table."""
    yield backward_specs("bf16", 128, 16, 1, 4, sparse=True, has_dlse=False)
    yield backward_specs("fp16", 64, 16, 64, 2, sparse=False, has_dlse=True)
    yield page_norm_specs(16, 128)


def full() -> Iterator[Spec]:
    """The cross product of dtypes, head dims, page sizes and kernel modes (slow: minutes)."""
    for dtype, d, s, (tq, g), sparse, split in itertools.product(
            DTYPES, HEAD_DIMS, PAGE_SIZES, [(1, 1), (1, 3), (1, 8), (128, 4)], (False, True), (False, True)):
        yield attention_specs(dtype, d, s, tq, g, sparse, split)
    for dtype, kv, d, sparse in itertools.product(DTYPES, ("i8", "fp8e4nv"), HEAD_DIMS, (False, True)):
        yield attention_specs(dtype, d, 16, 1, 4, sparse, sparse, kv=kv)
    for dtype, d, s in itertools.product(DTYPES, HEAD_DIMS, PAGE_SIZES):
        yield metadata_specs(dtype, dtype, d, s)
        yield metadata_specs(dtype, "fp32", d, s)
        yield scoring_specs(dtype, "fp32", d, s, 1, 4)
    for dtype, d, splits in itertools.product(DTYPES, HEAD_DIMS, (2, 7, 64)):
        yield merge_specs(dtype, 8, splits, d)
    for maxp, budget in [(8, 3), (2048, 128), (8192, 512)]:
        yield topk_specs(maxp, budget, 16)
    for dtype, d, (batch, maxp, budget) in itertools.product(
            DTYPES, (64, 128, 256), [(1, 2048, 128), (1, 8192, 128), (1, 8192, 512), (4, 32768, 128), (16, 2048, 8)]):
        yield from chunk_topk_specs(dtype, dtype, d, 16, 1, 4, batch, 8, maxp, budget)
    for pool, box, d, page in itertools.product(("fp32", "fp16", "bf16", "i8", "fp8e4nv"), ("", "fp32", "bf16"),
                                                HEAD_DIMS, PAGE_SIZES):
        yield kv_write_specs(pool, box, d, page)


class Recorded(NamedTuple):
    """One recorded launch (:func:`tinyattn.kernels.launches.record`), compiled as the GPU JIT would build it."""
    name: str
    launch: dict
    min_arch: int = 0


def record_launches(full: bool) -> list:
    """Run :mod:`tinyattn.kernels.launches` in a subprocess with ``TRITON_INTERPRET=1``; its recorded launches."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "launches.json")
        env = dict(os.environ, TRITON_INTERPRET="1")
        res = subprocess.run([sys.executable, "-m", "tinyattn.kernels.launches", "--out", out,
                              *(["--full"] if full else [])], env=env, capture_output=True, text=True)
        if res.returncode:
            raise RuntimeError(f"recording the launches failed:\n{res.stdout[-3000:]}{res.stderr[-3000:]}")
        with open(out) as f:
            return json.load(f)


def _materialize(desc):
    """A stand-in for a recorded argument: a tensor of its dtype at an address as aligned as the recorded one."""
    if "tensor" in desc:
        t = torch.empty(64, dtype=getattr(torch, desc["tensor"]))     # CPU allocations are 64-byte aligned
        return t if desc["aligned"] else t[1:]
    return desc["value"]


def jit_specialisation(launch: dict, arch: int):
    """``(kernel, signature, constexprs, attrs, options)`` of a recorded launch through Triton's own binder and
    ``_pack_args`` for ``sm_<arch>``: exactly what ``kernel[grid](...)`` compiles on that GPU."""
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    module, name = launch["kernel"].split(":")
    kernel = getattr(importlib.import_module(module), name)
    backend = make_backend(GPUTarget("cuda", arch, 32))
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    kwargs = {k: _materialize(v) for k, v in launch["args"].items()}
    kwargs.setdefault("debug", False)
    bound, specialization, options = binder(**kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    return kernel, signature, constexprs, attrs, options


def recorded_specs(launches: list) -> List[Recorded]:
    """One :class:`Recorded` per distinct binary (same kernel, signature, constexprs, attributes and options)."""
    seen, out = set(), []
    for launch in launches:
        kernel, signature, constexprs, attrs, options = jit_specialisation(launch, 90)
        key = (launch["kernel"], tuple(signature.items()), tuple(sorted(constexprs.items())),
               tuple(sorted((k, str(v)) for k, v in attrs.items())), options.num_warps, options.num_stages)
        if key in seen:
            continue
        seen.add(key)
        fp8 = any("float8" in d.get("tensor", "") for d in launch["args"].values())
        short = launch["kernel"].split(":")[1].strip("_").removesuffix("_kernel")
        out.append(Recorded(f"{short}[{launch['shape']}: {launch.get('phase', '')}]", launch, 89 if fp8 else 0))
    return out


def describe(spec) -> str:
    """What a recorded specialisation fixed: ints specialised to 1 and divisible by 16, constexprs, warps."""
    if not isinstance(spec, Recorded):
        return f"{spec.constexprs} num_warps={spec.num_warps}"
    kernel, signature, constexprs, attrs, options = jit_specialisation(spec.launch, 90)
    names = list(signature)
    declared = {p.name for p in kernel.params if p.is_constexpr}
    ones = [names[i[0]] for i in constexprs if names[i[0]] not in declared]
    div16 = [names[i[0]] for i, a in attrs.items() if a]
    meta = {names[i[0]]: v for i, v in constexprs.items() if names[i[0]] in declared}
    return (f"{' '.join(f'{k}:{v}' for k, v in signature.items() if v.startswith('*'))} | =1: {','.join(ones)} | "
            f"%16: {','.join(div16)} | {meta} num_warps={options.num_warps}")


def _dedupe(specs) -> List[Spec]:
    """Drop specialisations that compile to the same binary (e.g. head dims 40 and 64 both pad to 64)."""
    seen, out = set(), []
    for spec in specs:
        key = (spec.fn.__name__, tuple(sorted(spec.signature.items())), tuple(sorted(spec.constexprs.items())),
               spec.num_warps)
        if key not in seen:
            seen.add(key)
            out.append(spec)
    return out


def compile_spec(spec, arch: int):
    """Compile one specialisation (:class:`Spec` or :class:`Recorded`) to cubin for ``sm_<arch>``."""
    if isinstance(spec, Recorded):
        kernel, signature, constexprs, attrs, options = jit_specialisation(spec.launch, arch)
        src = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
        return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options.__dict__)
    src = triton.compiler.ASTSource(fn=spec.fn, signature=spec.signature, constexprs=spec.constexprs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": spec.num_warps})


def resource_usage(kernel, arch: int) -> str:
    """``regs=R spills=S/L smem=B`` of a compiled kernel: registers per thread and spill stores / loads (bytes)
    from ``ptxas -v`` over its PTX (the driver that would report them is absent), shared memory from Triton."""
    import re
    import subprocess
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    smem = getattr(kernel.metadata, "shared", "?")
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(kernel.asm["ptx"])
        res = subprocess.run([get_ptxas(arch).path, "-v", "--regAllocOptLevel=2",
                              f"--gpu-name={sm_arch_from_capability(arch)}", src, "-o", os.path.join(tmp, "k.o")],
                             capture_output=True, text=True)
    log = res.stdout + res.stderr
    regs = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    return (f"regs={regs.group(1) if regs else '?'} "
            f"spills={spills.group(1) + '/' + spills.group(2) if spills else '?'} smem={smem}")


def compile_all(archs: List[int], specs: list, verbose: bool = True, usage: bool = True,
                results: list | None = None) -> List[str]:
    """Compile ``specs`` for every arch; returns the failures (name, arch, error), prints timings and, with
    ``usage``, each kernel's registers, spills and shared memory (:func:`resource_usage`); ``results`` collects
    ``(arch, spec, status)``."""
    failures = []
    start = time.perf_counter()
    for arch in archs:
        for spec in specs:
            t0 = time.perf_counter()
            if arch < spec.min_arch:
                if verbose:
                    print(f"sm_{arch} {spec.name:<60} skipped (needs sm_{spec.min_arch}+)", flush=True)
                continue
            try:
                kernel = compile_spec(spec, arch)
                assert kernel.asm.get("cubin"), "no cubin produced"
                status = "ok " + (resource_usage(kernel, arch) if usage else "")
            except Exception as exc:  # report every failure, not only the first
                status = f"FAILED: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                failures.append(f"sm_{arch} {spec.name}: {status}")
            if results is not None:
                results.append((arch, spec, status))
            if verbose:
                print(f"sm_{arch} {spec.name:<60} {time.perf_counter() - t0:6.2f}s {status}", flush=True)
    if verbose:
        count = sum(arch >= spec.min_arch for arch in archs for spec in specs)
        print(f"compiled {count} specialisations in {time.perf_counter() - start:.1f}s, "
              f"{len(failures)} failed", flush=True)
    return failures


def markdown_table(results: list, arch: int) -> str:
    """The ``sm_<arch>`` rows of ``results`` as a Markdown table: kernel[first shape row], regs, spills, smem."""
    lines = [f"| kernel [shape row: phase] (sm_{arch}) | registers | spill stores / loads (B) | shared memory (B) |",
             "|---|---:|---:|---:|"]
    for a, spec, status in results:
        if a != arch:
            continue
        fields = dict(f.split("=", 1) for f in status.split()[1:] if "=" in f) if status.startswith("ok") else {}
        lines.append(f"| {spec.name} | {fields.get('regs', '-')} | {fields.get('spills', status[:40])} | "
                     f"{fields.get('smem', '-')} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, action="append", help="SM version, e.g. 80 or 90 (repeatable)")
    parser.add_argument("--full", action="store_true", help="every row of the shape table, not the default rows")
    parser.add_argument("--cross", action="store_true", help="the heuristics' cross product instead (slow)")
    parser.add_argument("--list", action="store_true", help="print the specialisations and exit")
    parser.add_argument("--table", action="store_true", help="end with a Markdown table per arch")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        parser.error("TRITON_INTERPRET=1 is set: unset it, compile-only needs the real compiler")
    if args.cross:
        specs = _dedupe(full())
    else:
        specs = recorded_specs(record_launches(args.full)) + _dedupe(extra())
    if args.list:
        for spec in specs:
            print(spec.name, describe(spec))
        return 0
    results: list = []
    archs = args.arch or [80, 90]
    failures = compile_all(archs, specs, results=results)
    if args.table:
        for arch in archs:
            print()
            print(markdown_table(results, arch))
    for failure in failures:
        print(failure, file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
