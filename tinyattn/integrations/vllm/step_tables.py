"""The vLLM backend's step tables in buffers allocated once, at capacity (no vLLM import; unit-tested in the main suite).

A CUDA graph replays kernels on the addresses it captured: every table a captured attention step reads must
live at the same address at every step, and a step may only copy its values into it. vLLM's own backends keep
such persistent buffers in their metadata builders (``triton_attn``'s scratch, ``flashinfer``'s
``paged_kv_indptr``); :class:`StepTables` is tinyattn's, held by
:class:`tinyattn.integrations.vllm.backend.TinyAttnMetadataBuilder`:

    block_table : int32 [max_num_seqs, max_pages_per_seq]   tinyattn page ids = 2 x vLLM block ids
    seq_lens    : int32 [max_num_seqs]                      tokens per request, the step's queries included

:meth:`StepTables.load` copies a step's vLLM tables into rows ``[0, R)`` (two kernel launches, no allocation, no
host sync) and returns views of those rows, which the step's plans are made on. The translation ``x 2`` is
:mod:`tinyattn.integrations.vllm.paging`'s (page ``2b`` = keys of vLLM block ``b``).
"""

from __future__ import annotations

import torch

__all__ = ["StepTables"]


class StepTables:
    """Persistent ``block_table`` / ``seq_lens`` buffers of one metadata builder.

    Args:
        max_num_seqs: rows (requests per step, padding rows of a CUDA-graph batch included): vLLM's
            ``scheduler_config.max_num_seqs`` or its largest graph capture size, whichever is larger.
        max_pages_per_seq: columns: vLLM's block-table width (``block_table_width``), at least
            ``ceil(max_model_len / block_size)``.
        device: where the buffers live (the builder's device).

    Raises:
        ValueError naming the argument unless both are ints ``>= 1``.
    """

    def __init__(self, max_num_seqs: int, max_pages_per_seq: int, *, device: torch.device | str):
        for name, value in (("max_num_seqs", max_num_seqs), ("max_pages_per_seq", max_pages_per_seq)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {value!r}")
        self.block_table = torch.zeros(max_num_seqs, max_pages_per_seq, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(max_num_seqs, dtype=torch.int32, device=device)

    @property
    def max_num_seqs(self) -> int:
        return self.block_table.shape[0]

    @property
    def max_pages_per_seq(self) -> int:
        return self.block_table.shape[1]

    def load(self, block_table: torch.Tensor, seq_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy one step's vLLM tables in; return ``(block_table, seq_lens)`` views of rows ``[0, R)``.

        Args:
            block_table: ``[R, W]`` vLLM block ids (int32, on the buffers' device). Columns past
                ``max_pages_per_seq`` are not copied (vLLM's table may be wider than the pages a request can
                use); a narrower table has the remaining columns of its rows zeroed (the null block's ids).
            seq_lens: ``[R]`` tokens per request including the step's queries (0 for padding rows).

        Returns:
            int32 views ``[R, max_pages_per_seq]`` (tinyattn page ids ``2 x`` vLLM's) and ``[R]`` of the buffers:
            the same storage at every step.

        Raises:
            ValueError when ``R`` exceeds ``max_num_seqs`` or the shapes disagree.
        """
        if block_table.dim() != 2 or seq_lens.shape != block_table.shape[:1]:
            raise ValueError(f"block_table, seq_lens: expected [R, W] and [R], got {tuple(block_table.shape)} and "
                             f"{tuple(seq_lens.shape)}")
        rows, width = block_table.shape
        if rows > self.max_num_seqs:
            raise ValueError(f"block_table: expected at most max_num_seqs={self.max_num_seqs} rows (the "
                             f"capacity allocated at start-up), got {rows}")
        cols = min(width, self.max_pages_per_seq)
        bt = self.block_table[:rows]
        torch.mul(block_table[:, :cols], 2, out=bt[:, :cols])
        if cols < self.max_pages_per_seq:
            bt[:, cols:].zero_()
        sl = self.seq_lens[:rows]
        sl.copy_(seq_lens)
        return bt, sl
