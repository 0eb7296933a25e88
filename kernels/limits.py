"""What the Triton kernels accept (tile sizes, dtypes) and whether Triton is importable: shared by the
dispatcher and the kernels, so neither imports the other."""

from __future__ import annotations

import os

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


def check_operands(same_device: dict[str, torch.Tensor], same_dtype: dict[str, torch.Tensor]) -> None:
    """One-line errors unless every ``same_device`` tensor sits on one device, the ``same_dtype`` tensors share a
    :data:`SUPPORTED_DTYPES` dtype, and they are CUDA tensors (or CPU ones under ``TRITON_INTERPRET=1``)."""
    if len({tensor.device for tensor in same_device.values()}) != 1:
        raise ValueError(f"{_listed(same_device)} must be on the same device")
    dtypes = [tensor.dtype for tensor in same_dtype.values()]
    if len(set(dtypes)) != 1:
        raise ValueError(f"{', '.join(same_dtype)} must share a dtype, got {', '.join(map(str, dtypes))}")
    if dtypes[0] not in SUPPORTED_DTYPES:
        raise ValueError(f"unsupported dtype {dtypes[0]}; expected float16, bfloat16 or float32")
    first = next(iter(same_device.values()))
    if not first.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("the Triton kernels need CUDA tensors, or TRITON_INTERPRET=1 for CPU tensors")


def _listed(operands: dict[str, torch.Tensor]) -> str:
    names = list(operands)
    return ", ".join(names[:-1]) + " and " + names[-1]
