"""What the Triton kernels accept (tile sizes, dtypes) and whether Triton is importable: shared by the
dispatcher and the kernels, so neither imports the other."""

from __future__ import annotations

import torch

MIN_BLOCK = 16  # tl.dot's smallest tile: the kernels' blocks and head dims are powers of two of at least this
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # what the Triton kernels compute in


def tileable_head_dim(head_dim: int) -> bool:
    """Whether the Triton kernels tile ``head_dim``: a power of two of at least :data:`MIN_BLOCK`."""
    return head_dim >= MIN_BLOCK and head_dim & (head_dim - 1) == 0


def check_head_dim(head_dim: int) -> None:
    """A ValueError naming the rule unless the Triton kernels tile ``head_dim`` (:func:`tileable_head_dim`)."""
    if not tileable_head_dim(head_dim):
        raise ValueError(f"head_dim must be a power of two >= {MIN_BLOCK}, got {head_dim}")


def triton_available() -> bool:
    """Whether the Triton kernels can be imported on this machine."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
