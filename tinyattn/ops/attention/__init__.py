"""Paged attention: which keys each query sees (ragged tails, bottom-right causal, sliding window), softmax with its
natural-log lse (``-inf`` and a zero output for a query that sees nothing), dense or over listed pages, with
split-K partials merged by lse; and its backward.

Three forms of each rule, side by side: :mod:`.reference` (loops, the tests' oracle), :mod:`.torch_impl` (the
vectorised CPU path) and :mod:`.triton_impl` (launchers of ``kernels/attention.py`` and
``kernels/attention_bwd.py``). The public entry points are :func:`tinyattn.paged_attention` and
:func:`tinyattn.sparse_paged_attention`; a plan (:class:`tinyattn.PagedAttentionPlan`) calls the forms directly.
"""
