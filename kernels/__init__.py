"""Fused compression path: score-biased attention and top-k compaction.

Installed as ``curkv_train.kernels``. Each public function dispatches between a
Triton kernel (CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``) and the
PyTorch reference in :mod:`curkv_train.kernels.reference` with identical semantics.
"""

from curkv_train.kernels.dispatch import BACKENDS, compact_kept, scored_attention

__all__ = ["BACKENDS", "compact_kept", "scored_attention"]
