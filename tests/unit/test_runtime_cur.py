"""CUR factors of the cold tier: exactness at full rank, error vs rank, residual compensation, bytes."""

import pytest
import torch

from curkv_train.runtime import cur



pytestmark = pytest.mark.usefixtures("single_thread")


def decaying_matrix(tokens: int = 256, channels: int = 16, seed: int = 0) -> torch.Tensor:
    """(tokens, channels) float64 with singular values falling from 1 to 1e-3."""
    generator = torch.Generator().manual_seed(seed)
    left = torch.linalg.qr(torch.randn(tokens, channels, generator=generator, dtype=torch.float64)).Q
    right = torch.linalg.qr(torch.randn(channels, channels, generator=generator, dtype=torch.float64)).Q
    return (left * torch.logspace(0, -3, channels, dtype=torch.float64)) @ right.T


def spiky_matrix(tokens: int = 256, channels: int = 16, spikes: int = 40) -> torch.Tensor:
    """Rank 4 plus a few large isolated entries plus small noise (float32)."""
    generator = torch.Generator().manual_seed(1)
    low_rank = torch.randn(tokens, 4, generator=generator) @ torch.randn(4, channels, generator=generator)
    sparse = torch.zeros(tokens * channels)
    sparse[torch.randperm(tokens * channels, generator=generator)[:spikes]] = 10 * torch.randn(spikes, generator=generator)
    return low_rank + sparse.view(tokens, channels) + 0.01 * torch.randn(tokens, channels, generator=generator)


def relative_error(factors: cur.CurFactors, matrix: torch.Tensor) -> float:
    return float((cur.reconstruct(factors) - matrix).norm() / matrix.norm())


@pytest.mark.parametrize("core", cur.CORES)
def test_full_rank_is_exact(core):
    matrix = decaying_matrix()
    factors = cur.cur_decompose(matrix, rank_rows=16, rank_cols=16, core=core)
    assert factors.columns.shape == (256, 16) and factors.rows.shape == (16, 16)
    torch.testing.assert_close(cur.reconstruct(factors), matrix)


def test_full_rank_is_exact_in_float32_batched():
    keys = torch.randn(2, 3, 64, 16, generator=torch.Generator().manual_seed(0))
    factors = cur.cur_decompose(keys, rank_rows=16, rank_cols=16)
    # float32 through a 16 × 16 pseudo-inverse: errors up to ~2e-3 over 200 random seeds
    torch.testing.assert_close(cur.reconstruct(factors), keys, atol=5e-3, rtol=5e-3)
    assert cur.reconstruct(factors).dtype == keys.dtype


def test_error_falls_as_rank_grows():
    matrix = decaying_matrix()
    errors = [relative_error(cur.cur_decompose(matrix, rank, rank), matrix) for rank in (2, 4, 8, 12, 16)]
    assert all(later < earlier for earlier, later in zip(errors, errors[1:])), errors
    assert errors[-1] < 1e-10


def test_optimal_core_never_worse_than_intersection():
    matrix = spiky_matrix()
    for rank in (2, 4, 8):
        optimal = relative_error(cur.cur_decompose(matrix, rank, rank, core="optimal"), matrix)
        intersection = relative_error(cur.cur_decompose(matrix, rank, rank, core="intersection"), matrix)
        assert optimal <= intersection + 1e-6
        assert optimal <= 1.0


def test_sketched_leverage_matches_exact_subspace_at_full_sketch():
    matrix = decaying_matrix()
    exact = cur.leverage_scores(matrix, rank=4, dim=-2)
    assert exact.shape == (256,)
    torch.testing.assert_close(exact.sum(), torch.tensor(4.0, dtype=torch.float64))
    sketched = cur.leverage_scores(matrix, rank=4, dim=-1, sketch=8, generator=torch.Generator().manual_seed(0))
    assert sketched.shape == (16,)
    torch.testing.assert_close(sketched.sum(), torch.tensor(4.0, dtype=torch.float64))


def test_residual_compensation_lowers_error_at_equal_bytes():
    matrix = spiky_matrix()
    base = cur.cur_decompose(matrix, 4, 4)
    for bigger_rank in (6, 8):
        bigger = cur.cur_decompose(matrix, bigger_rank, bigger_rank)
        entry_bytes = matrix.element_size() + torch.empty(0, dtype=cur.narrow_int_dtype(matrix.numel())).element_size()
        count = (cur.nbytes(bigger) - cur.nbytes(base)) // entry_bytes
        compensated = cur.compensate(base, matrix, count)
        assert cur.nbytes(compensated) <= cur.nbytes(bigger)
        assert relative_error(compensated, matrix) < 0.5 * relative_error(bigger, matrix)
    assert relative_error(cur.compensate(base, matrix, 100), matrix) < relative_error(base, matrix)


@pytest.mark.parametrize("residual", [0, 30])
def test_dropping_leading_tokens_keeps_the_rest_exactly(residual):
    matrix = torch.stack([spiky_matrix(), spiky_matrix() * 0.5])  # two heads: their residuals differ
    factors = cur.cur_decompose(matrix, 4, 4)
    factors = cur.compensate(factors, matrix, residual) if residual else factors
    dropped = cur.drop_leading(factors, 100)
    assert dropped.shape == (2, 156, 16)
    torch.testing.assert_close(cur.reconstruct(dropped), cur.reconstruct(factors)[:, 100:], atol=1e-5, rtol=0)
    assert cur.nbytes(dropped) < cur.nbytes(factors)


def test_nbytes_counts_every_tensor_and_narrow_indices():
    matrix = spiky_matrix()
    factors = cur.compensate(cur.cur_decompose(matrix, 4, 8), matrix, 10)
    assert factors.residual_index.dtype == torch.int16
    expected = (256 * 8 + 4 * 16) * 4 + 8 * 4 * 4 + 10 * 4 + 10 * 2
    assert cur.nbytes(factors) == expected


def test_narrow_int_dtype():
    assert cur.narrow_int_dtype(32767) == torch.int16
    assert cur.narrow_int_dtype(32768) == torch.int32
    assert cur.narrow_int_dtype(2**31) == torch.int64


def test_unknown_core_rejected():
    with pytest.raises(ValueError, match="unknown CUR core"):
        cur.cur_decompose(torch.randn(8, 4), 2, 2, core="svd")
