"""Scoring and selection: the Quest bound of every page (``ub(q, j) = Σ_i max(q_i·k_min_i, q_i·k_max_i)``, max over
the GQA group and the queries), the pages a sliding window hides, and the selection of ``page_budget`` pages per
(row, KV head): forced recent / sink pages, then the best bounds, NaN as ``-inf``, ties to the lower page. With
``gamma < 1`` the bound becomes the box estimate ``q·c + gamma·|q|·r``; with ``top_p`` the selection keeps only the
fewest best pages whose estimated mass ``softmax(scale · score)`` reaches it (Twilight, arXiv 2502.02770).

Three forms of each rule, side by side: :mod:`.reference` (loops, the tests' oracle), :mod:`.torch_impl` (the
vectorised CPU path) and :mod:`.triton_impl` (launchers of ``kernels/scoring.py``, ``kernels/topk.py`` and the
two-stage ``kernels/chunk_topk.py``). The public entry points are :func:`tinyattn.page_scores` and
:func:`tinyattn.select_pages`; a plan (:class:`tinyattn.PagedAttentionPlan`) calls the forms directly.
Source: Quest (Tang et al., ICML 2024, §3.2-3.3), TinyServe (Liu & Yu, arXiv 2509.12211, eq. 2).
"""
