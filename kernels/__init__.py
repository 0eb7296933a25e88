"""Fused compression path: score-biased attention, top-k compaction, attention over CUR-factored blocks,
attention over ragged KV storage (:mod:`curkv_train.kernels.ragged`: the format and its pack / append helpers).

The query features' attention-sized parts have their kernels in :mod:`curkv_train.kernels.query_features_triton`,
dispatched by :func:`curkv_train.core.features.query_features` (its torch path is their reference).

Installed as ``curkv_train.kernels``. Each public function dispatches between a
Triton kernel (CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``) and the
PyTorch reference in :mod:`curkv_train.kernels.reference` with identical semantics.
"""

from curkv_train.kernels.dispatch import (
    BACKENDS,
    compact_kept,
    factored_attention,
    ragged_attention,
    scored_attention,
)
from curkv_train.kernels.ragged import RaggedKV, append_ragged, pack_ragged

__all__ = [
    "BACKENDS",
    "RaggedKV",
    "append_ragged",
    "compact_kept",
    "factored_attention",
    "pack_ragged",
    "ragged_attention",
    "scored_attention",
]
