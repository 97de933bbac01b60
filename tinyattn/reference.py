"""``tinyattn.reference``: the pure-PyTorch loop twins of the public ops (DESIGN.md §3), fp32 math.

The same functions as :mod:`tinyattn.ops.reference` (where they live, beside the ops they mirror), importable
under the name the docs use: ``import tinyattn.reference`` or ``from tinyattn.reference import paged_attention``.
"""

from .ops.reference import (__all__, encode_key_codes, page_scores, paged_attention, rerank_scores,  # noqa: F401
                            select_pages, sparse_paged_attention, update_page_metadata, write_kv)
