"""CUR factors for the cold tier (DESIGN §6): pure functions, batched over leading dims.

A block of cached keys (or values) M (n tokens × d channels) per (batch, KV head) is
held as

    M ≈ C · U · R  (+ S)

with C = M[:, J] the selected channels (n × c), R = M[I, :] the selected tokens
(r × d), U (c × r), and S an optional sparse residual: the largest-magnitude entries
of M − C·U·R, kept as (value, flat index) pairs and added back on reconstruction.
Channels J and tokens I are the top (sketched) leverage scores of M's leading
singular subspace.

U is either ``intersection`` = pinv(M[I, J]) (DESIGN §6 as written) or ``optimal`` =
pinv(C)·M·pinv(R), the U that minimises ‖M − C·U·R‖_F for the chosen C and R. Both
hold the same bytes and are exact at full rank; the intersection's pseudo-inverse
blows up when M[I, J] is ill-conditioned (relative errors above 1, i.e. worse than
dropping the block, on key-like blocks with an outlier channel), so ``optimal`` is
the default.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Callable

import torch


def narrow_int_dtype(max_value: int) -> torch.dtype:
    """The smallest signed integer dtype that holds 0..``max_value`` (int16, int32 or int64)."""
    if max_value < 2**15:
        return torch.int16
    if max_value < 2**31:
        return torch.int32
    return torch.int64


@dataclass
class CurFactors:
    """A matrix M (..., n, d) held as C·U·R plus an optional sparse residual.

    Attributes:
        columns: (..., n, c) C, the selected channels of every token (M's dtype).
        core: (..., c, r) U (``optimal`` pinv(C)·M·pinv(R) or ``intersection`` pinv(M[I, J]), see
              :func:`cur_decompose`), float32 (float64 for float64 input).
        rows: (..., r, d) R, the selected tokens (M's dtype).
        residual_values: (..., m) the kept residual entries, or None.
        residual_index: (..., m) their flat indices into n·d (narrowest int dtype), or None.
    """

    columns: torch.Tensor
    core: torch.Tensor
    rows: torch.Tensor
    residual_values: torch.Tensor | None = None
    residual_index: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape (..., n, d) of the matrix these factors stand for."""
        return (*self.columns.shape[:-1], self.rows.shape[-1])

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor held."""
        return [getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None]

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "CurFactors":
        """The same factors with ``fn`` applied to every held tensor (e.g. a batch selection)."""
        return replace(self, **{f.name: fn(getattr(self, f.name)) for f in fields(self)
                                if getattr(self, f.name) is not None})


def _compute_dtype(matrix: torch.Tensor) -> torch.dtype:
    return torch.float64 if matrix.dtype == torch.float64 else torch.float32


def leverage_scores(matrix: torch.Tensor, rank: int, dim: int = -2, sketch: int | None = None,
                    generator: torch.Generator | None = None) -> torch.Tensor:
    """Rank-``rank`` leverage scores of the rows (dim=-2) or columns (dim=-1) of ``matrix``.

    The leverage of row i is ‖U_k[i, :]‖² with U_k the top-k left singular vectors
    (columns likewise with the right ones); the scores sum to k.

    Args:
        matrix: (..., n, d).
        rank: k, the singular subspace the scores refer to.
        dim: -2 for rows, -1 for columns.
        sketch: if set and smaller than the other side, the subspace is found from a
            Gaussian sketch with this many columns (randomized range finder) instead of a full SVD.
        generator: random source of the sketch.

    Returns:
        (..., n) for rows or (..., d) for columns, float32 (float64 for float64 input).
    """
    if dim not in (-1, -2):
        raise ValueError(f"dim must be -2 (rows) or -1 (columns), got {dim}")
    work = matrix.to(_compute_dtype(matrix))
    if dim == -1:
        work = work.transpose(-1, -2)
    rank = max(1, min(rank, *work.shape[-2:]))
    if sketch is not None and max(sketch, rank) < work.shape[-1]:
        omega = torch.randn(work.shape[-1], max(sketch, rank), dtype=work.dtype, generator=generator)
        basis = torch.linalg.qr(work @ omega.to(work.device)).Q
        small_left = torch.linalg.svd(basis.transpose(-1, -2) @ work, full_matrices=False).U
        left = basis @ small_left
    else:
        left = torch.linalg.svd(work, full_matrices=False).U
    return left[..., :rank].square().sum(dim=-1)


def _top_sorted(scores: torch.Tensor, count: int) -> torch.Tensor:
    """Indices (..., count) of the ``count`` largest scores, in increasing index order."""
    return scores.topk(count, dim=-1).indices.sort(dim=-1).values


CORES = ("optimal", "intersection")


def cur_decompose(matrix: torch.Tensor, rank_rows: int, rank_cols: int, sketch: int | None = None,
                  generator: torch.Generator | None = None, core: str = "optimal") -> CurFactors:
    """CUR factors of ``matrix`` (..., n, d) from its top-leverage tokens and channels.

    Args:
        matrix: (..., n, d), e.g. one cold block's keys (batch, kv_heads, tokens, head_dim).
        rank_rows: r, tokens kept in R (clipped to n).
        rank_cols: c, channels kept in C (clipped to d).
        sketch, generator: see :func:`leverage_scores`.
        core: ``optimal`` U = pinv(C)·M·pinv(R) or ``intersection`` U = pinv(M[I, J]).

    Returns:
        Factors with C (..., n, c), U (..., c, r), R (..., r, d). With c = d, r ≥ d and
        M of full column rank the reconstruction is exact.
    """
    if core not in CORES:
        raise ValueError(f"unknown CUR core {core!r}; expected one of {', '.join(CORES)}")
    n, d = matrix.shape[-2:]
    rank_rows, rank_cols = max(1, min(rank_rows, n)), max(1, min(rank_cols, d))
    subspace = min(rank_rows, rank_cols)
    channel_idx = _top_sorted(leverage_scores(matrix, subspace, -1, sketch, generator), rank_cols)
    token_idx = _top_sorted(leverage_scores(matrix, subspace, -2, sketch, generator), rank_rows)
    columns = matrix.gather(-1, channel_idx.unsqueeze(-2).expand(*matrix.shape[:-1], rank_cols))
    rows = matrix.gather(-2, token_idx.unsqueeze(-1).expand(*matrix.shape[:-2], rank_rows, d))
    work = _compute_dtype(matrix)
    if core == "optimal":
        middle = torch.linalg.pinv(columns.to(work)) @ matrix.to(work) @ torch.linalg.pinv(rows.to(work))
    else:
        intersection = rows.gather(-1, channel_idx.unsqueeze(-2).expand(*rows.shape[:-1], rank_cols))
        middle = torch.linalg.pinv(intersection.to(work))
    return CurFactors(columns=columns.contiguous(), core=middle.contiguous(), rows=rows.contiguous())


def reconstruct(factors: CurFactors) -> torch.Tensor:
    """The matrix (..., n, d) the factors stand for: C·(U·R) plus the sparse residual, in C's dtype."""
    core_rows = factors.core @ factors.rows.to(factors.core.dtype)
    matrix = factors.columns.to(factors.core.dtype) @ core_rows
    if factors.residual_values is not None:
        flat = matrix.flatten(-2)
        flat.scatter_add_(-1, factors.residual_index.long(), factors.residual_values.to(flat.dtype))
        matrix = flat.view_as(matrix)
    return matrix.to(factors.columns.dtype)


def drop_leading(factors: CurFactors, count: int) -> CurFactors:
    """The factors of M[..., count:, :]: C without its first ``count`` rows (U and R, the basis the rest is
    written in, kept), exactly the remaining rows of C·U·R. The residual keeps its shape (the same entry count
    for every head): entries of dropped tokens become 0 at index 0, the others move ``count`` rows up."""
    columns = factors.columns[..., count:, :].clone()  # a copy: a view would keep the dropped rows' memory
    if factors.residual_index is None:
        return replace(factors, columns=columns)
    index = factors.residual_index.long() - count * factors.rows.shape[-1]
    return replace(factors, columns=columns, residual_values=factors.residual_values.masked_fill(index < 0, 0),
                   residual_index=index.clamp_min(0).to(factors.residual_index.dtype))


def residual_topk(matrix: torch.Tensor, approximation: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``count`` largest-magnitude entries of matrix − approximation, both (..., n, d).

    Returns:
        (values (..., count) in the matrix's dtype, flat indices (..., count) in the narrowest int dtype).
    """
    residual = (matrix.to(approximation.dtype) - approximation).flatten(-2)
    count = min(count, residual.shape[-1])
    index = residual.abs().topk(count, dim=-1).indices.sort(dim=-1).values
    values = residual.gather(-1, index).to(matrix.dtype)
    return values, index.to(narrow_int_dtype(residual.shape[-1] - 1))


def compensate(factors: CurFactors, matrix: torch.Tensor, count: int) -> CurFactors:
    """``factors`` with the ``count`` largest entries of the residual matrix − C·U·R kept sparsely."""
    bare = replace(factors, residual_values=None, residual_index=None)
    values, index = residual_topk(matrix, reconstruct(bare), count)
    return replace(bare, residual_values=values, residual_index=index)


def residual_count(tokens: int, channels: int, ratio: float) -> int:
    """Residual entries kept for a (tokens × channels) block at ``ratio`` of its entries (⌈ratio·n·d⌉)."""
    return math.ceil(ratio * tokens * channels)


def nbytes(factors: CurFactors) -> int:
    """Bytes held by the factors (C, U, R and the residual's values and indices)."""
    return sum(t.numel() * t.element_size() for t in factors.tensors())
