"""Ragged KV storage and attention over it: reference vs SDPA, Triton vs reference, pack / append, bytes held.

CPU, TRITON_INTERPRET=1. Shapes are tiny and key blocks are 16 so that segments span
several blocks (and token splits) while the interpreter stays fast.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from curkv_train.kernels import RaggedKV, append_ragged, pack_ragged, ragged_attention
from curkv_train.kernels.ragged_attention_triton import ragged_attention_triton
from curkv_train.kernels.reference import ragged_attention_reference

# (atol, rtol) of the kernel against the reference on the same inputs. bf16: the kernel feeds
# bf16 probabilities to P @ V and both outputs are rounded to bf16.
TOLERANCES = {torch.float32: (2e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2)}
BLOCK = 16


def kept_indices(lengths: list[list[int]], tokens: int, seed: int) -> list[list[torch.Tensor]]:
    """Random ascending token indices per (batch, KV head), lengths[b][h] of them, the last token always kept."""
    gen = torch.Generator().manual_seed(seed)
    keep = []
    for per_head in lengths:
        row = []
        for length in per_head:
            older = torch.randperm(tokens - 1, generator=gen)[: max(length - 1, 0)].sort().values
            row.append(torch.cat([older, torch.tensor([tokens - 1])]) if length else older)
        keep.append(row)
    return keep


def make_case(lengths, group=2, num_queries=1, head_dim=16, dtype=torch.float32, tokens=None, headroom=0, seed=0):
    """Dense K / V, the kept indices, their ragged cache and queries (batch, kv_heads·group, M, head_dim)."""
    batch, kv_heads = len(lengths), len(lengths[0])
    tokens = tokens or max(max(row) for row in lengths)
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(batch, kv_heads, tokens, head_dim, generator=gen).to(dtype)
    values = torch.randn(batch, kv_heads, tokens, head_dim, generator=gen).to(dtype)
    q = torch.randn(batch, kv_heads * group, num_queries, head_dim, generator=gen).to(dtype)
    keep = kept_indices(lengths, tokens, seed)
    return keys, values, keep, pack_ragged(keys, values, keep, headroom=headroom), q


def per_head_sdpa(q, keys, values, keep, scale=None):
    """Independent oracle: SDPA per query head on its KV head's own kept tokens, bottom-right causal."""
    batch, q_heads, num_queries, _ = q.shape
    group = q_heads // keys.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for b in range(batch):
        for h in range(q_heads):
            index = keep[b][h // group]
            own_keys, own_values = keys[b, h // group, index].double(), values[b, h // group, index].double()
            length = index.numel()
            visible = torch.arange(length)[None, :] <= torch.arange(num_queries)[:, None] + length - num_queries
            if length == 0:
                continue
            rows = F.scaled_dot_product_attention(q[b, h].double()[None], own_keys[None], own_values[None],
                                                  attn_mask=visible[None], scale=scale)[0]
            out[b, h] = torch.where(visible.any(-1, keepdim=True), rows, 0.0)  # a row that sees nothing gives 0
    return out


def run_kernel(cache: RaggedKV, q: torch.Tensor, **kwargs) -> torch.Tensor:
    return ragged_attention_triton(q, cache.keys, cache.values, cache.offsets, cache.lengths, block_n=BLOCK, **kwargs)


def run_reference(cache: RaggedKV, q: torch.Tensor, **kwargs) -> torch.Tensor:
    return ragged_attention_reference(q, cache.keys, cache.values, cache.offsets, cache.lengths, **kwargs)


def assert_matches(got, want, dtype):
    atol, rtol = TOLERANCES[dtype]
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("num_queries", [1, 4], ids=["decode", "chunk"])
@pytest.mark.parametrize("group", [1, 3])
def test_reference_equals_dense_sdpa_at_full_length(num_queries, group):
    """Every segment holding every token: the reference is dense GQA SDPA, bottom-right causal."""
    keys, values, _, cache, q = make_case([[9, 9], [9, 9]], group=group, num_queries=num_queries, dtype=torch.float64)
    visible = torch.arange(9)[None, :] <= torch.arange(num_queries)[:, None] + 9 - num_queries
    want = F.scaled_dot_product_attention(q, keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1),
                                          attn_mask=visible)
    torch.testing.assert_close(run_reference(cache, q), want, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("num_queries", [1, 3], ids=["decode", "chunk"])
def test_reference_equals_per_head_sdpa_on_kept_tokens(num_queries):
    """Lengths 0, 1 (shorter than the chunk: its earlier queries see nothing), 7 and 20, GQA group 3."""
    keys, values, keep, cache, q = make_case([[7, 1], [20, 0]], group=3, num_queries=num_queries, dtype=torch.float64)
    torch.testing.assert_close(run_reference(cache, q, scale=0.3), per_head_sdpa(q, keys, values, keep, scale=0.3),
                               atol=1e-12, rtol=1e-12)


# (lengths [batch][kv_head], group, M, head_dim, dtype): decode and prefill chunks, GQA 1 / 3 / 4, head_dim 64 and 256,
# segments of one token, fp32 and bf16.
KERNEL_CASES = [
    ([[33, 1], [17, 48]], 1, 1, 64, torch.float32),
    ([[33, 1], [17, 48]], 3, 1, 64, torch.bfloat16),
    ([[40, 5, 1]], 4, 6, 64, torch.float32),
    ([[21, 36]], 3, 5, 64, torch.bfloat16),
    ([[1, 1], [1, 1]], 4, 1, 64, torch.float32),
    ([[19, 2]], 2, 1, 256, torch.float32),
    ([[19, 34]], 2, 3, 256, torch.bfloat16),
]


@pytest.mark.parametrize("lengths,group,num_queries,head_dim,dtype", KERNEL_CASES,
                         ids=[f"L{c[0]}-g{c[1]}-M{c[2]}-d{c[3]}-{str(c[4])[6:]}" for c in KERNEL_CASES])
def test_kernel_matches_reference(single_thread, lengths, group, num_queries, head_dim, dtype):
    _, _, _, cache, q = make_case(lengths, group=group, num_queries=num_queries, head_dim=head_dim, dtype=dtype)
    got = run_kernel(cache, q)
    assert got.dtype == dtype and got.shape == q.shape
    assert_matches(got, run_reference(cache, q), dtype)


@pytest.mark.parametrize("num_splits", [2, 3])
def test_kernel_token_splits_match_the_reference(single_thread, num_splits):
    """Flash-decoding splits (some empty for the short segments) merge to the same attention."""
    _, _, _, cache, q = make_case([[50, 3], [1, 29]], group=3, num_queries=2)
    assert_matches(run_kernel(cache, q, num_splits=num_splits, scale=0.2), run_reference(cache, q, scale=0.2),
                   torch.float32)


def test_kernel_equals_per_head_sdpa(single_thread):
    """The kernel against the independent per-head oracle directly (not only through the reference)."""
    keys, values, keep, cache, q = make_case([[12, 1], [30, 4]], group=3, num_queries=2)
    torch.testing.assert_close(run_kernel(cache, q).double(), per_head_sdpa(q, keys, values, keep),
                               atol=2e-5, rtol=1e-5)


def test_headroom_is_never_read(single_thread):
    """Spare rows filled with NaN change nothing: both paths read only offsets ..< offsets + lengths."""
    _, _, _, cache, q = make_case([[20, 3], [9, 14]], group=2, num_queries=2, headroom=5)
    keys, values = cache.keys.clone(), cache.values.clone()
    held = torch.zeros(keys.shape[0], dtype=torch.bool)
    for start, length in zip(cache.offsets.flatten().tolist(), cache.lengths.flatten().tolist()):
        held[start:start + length] = True
    keys[~held], values[~held] = float("nan"), float("nan")
    poisoned = RaggedKV(keys, values, cache.offsets, cache.lengths, cache.capacities)
    want = run_reference(cache, q)
    assert_matches(run_reference(poisoned, q), want, torch.float32)
    assert_matches(run_kernel(poisoned, q), want, torch.float32)


def test_comparison_detects_a_wrong_offset(single_thread):
    """Negative control: one segment read one row off makes the kernel disagree with the reference."""
    _, _, _, cache, q = make_case([[20, 11], [9, 14]], group=2, num_queries=2)
    want = run_reference(cache, q)
    shifted = cache.offsets.clone()
    shifted[1, 0] += 1
    wrong = ragged_attention_triton(q, cache.keys, cache.values, shifted, cache.lengths, block_n=BLOCK)
    with pytest.raises(AssertionError):
        assert_matches(wrong, want, torch.float32)
    torch.testing.assert_close(wrong[0], want[0])  # only the shifted segment's heads change


def test_pack_holds_each_heads_kept_tokens_and_only_their_bytes():
    keys, values, keep, cache, _ = make_case([[7, 1], [20, 0]], head_dim=8, dtype=torch.bfloat16, tokens=24)
    for b in range(2):
        for h in range(2):
            segment_keys, segment_values = cache.segment(b, h)
            assert torch.equal(segment_keys, keys[b, h, keep[b][h]])
            assert torch.equal(segment_values, values[b, h, keep[b][h]])
    kept = sum(index.numel() for row in keep for index in row)  # 28, counted from the index lists
    expected = kept * 8 * 2 * 2  # tokens · head_dim · (keys + values) · bf16 bytes
    assert cache.bytes_held == expected
    assert cache.keys.untyped_storage().nbytes() + cache.values.untyped_storage().nbytes() == expected


def test_append_in_place_with_headroom_then_reallocate():
    keys, values, keep, cache, _ = make_case([[7, 1], [20, 3]], head_dim=8, headroom=2)
    gen = torch.Generator().manual_seed(3)
    steps = [(torch.randn(2, 2, 1, 8, generator=gen), torch.randn(2, 2, 1, 8, generator=gen)) for _ in range(3)]
    grown = cache
    for step, (new_keys, new_values) in enumerate(steps):
        before = grown.keys.data_ptr()
        grown = append_ragged(grown, new_keys, new_values, headroom=4)
        assert (grown.keys.data_ptr() == before) == (step < 2)  # two steps fit the headroom, the third copies once
    assert torch.equal(grown.lengths, cache.lengths + 3)
    assert grown.bytes_held == int((cache.lengths + 3 + 4).sum()) * 8 * 2 * 4
    appended_keys = torch.cat([k for k, _ in steps], dim=2)
    appended_values = torch.cat([v for _, v in steps], dim=2)
    for b in range(2):
        for h in range(2):
            segment_keys, segment_values = grown.segment(b, h)
            assert torch.equal(segment_keys, torch.cat([keys[b, h, keep[b][h]], appended_keys[b, h]]))
            assert torch.equal(segment_values, torch.cat([values[b, h, keep[b][h]], appended_values[b, h]]))


def test_decode_step_after_append_attends_to_the_new_token(single_thread):
    """Append one token per segment, then its query (M = 1) against the per-head oracle on kept + new tokens."""
    keys, values, keep, cache, q = make_case([[9, 2], [5, 13]], group=2, num_queries=1, tokens=16)
    gen = torch.Generator().manual_seed(4)
    new_keys, new_values = torch.randn(2, 2, 1, 16, generator=gen), torch.randn(2, 2, 1, 16, generator=gen)
    grown = append_ragged(cache, new_keys, new_values)
    all_keys, all_values = torch.cat([keys, new_keys], dim=2), torch.cat([values, new_values], dim=2)
    all_keep = [[torch.cat([index, torch.tensor([16])]) for index in row] for row in keep]
    want = per_head_sdpa(q, all_keys, all_values, all_keep)
    torch.testing.assert_close(run_kernel(grown, q).double(), want, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(run_reference(grown, q).double(), want, atol=1e-6, rtol=1e-6)


def test_dispatch_backends_agree(single_thread):
    _, _, _, cache, q = make_case([[20, 3], [9, 14]], group=2, num_queries=3)
    args = (q, cache.keys, cache.values, cache.offsets, cache.lengths)
    assert_matches(ragged_attention(*args, backend="triton"), ragged_attention(*args, backend="torch"), torch.float32)


def test_invalid_inputs_raise():
    _, _, keep, cache, q = make_case([[5, 3]], group=2)
    args = (cache.keys, cache.values, cache.offsets, cache.lengths)
    with pytest.raises(ValueError, match="multiple"):
        ragged_attention_triton(q[:, :3], *args)
    with pytest.raises(ValueError, match="offsets \\+ lengths"):
        ragged_attention_reference(q, cache.keys, cache.values, cache.offsets + 1, cache.lengths)
    with pytest.raises(ValueError, match="offsets \\+ lengths"):
        ragged_attention_triton(q, cache.keys, cache.values, cache.offsets, cache.lengths + 1)
    with pytest.raises(ValueError, match="power of two"):
        ragged_attention_triton(q[..., :12], cache.keys[:, :12], cache.values[:, :12], cache.offsets, cache.lengths)
    with pytest.raises(ValueError, match="unknown kernel backend"):
        ragged_attention(q, *args, backend="cuda")
    with pytest.raises(ValueError, match="outside"):
        pack_ragged(torch.zeros(1, 2, 5, 16), torch.zeros(1, 2, 5, 16), [[torch.tensor([5]), torch.tensor([0])]])
    with pytest.raises(ValueError, match="new_keys"):
        append_ragged(cache, torch.zeros(1, 3, 1, 16), torch.zeros(1, 3, 1, 16))
