"""Fused compression path: score-biased attention, top-k compaction, attention over CUR-factored blocks.

Installed as ``curkv_train.kernels``. Each public function dispatches between a
Triton kernel (CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``) and the
PyTorch reference in :mod:`curkv_train.kernels.reference` with identical semantics.
"""

from curkv_train.kernels.dispatch import BACKENDS, compact_kept, factored_attention, scored_attention

__all__ = ["BACKENDS", "compact_kept", "factored_attention", "scored_attention"]
