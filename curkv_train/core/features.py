"""The one feature function of query-aware scorers: what the observation window says about every cached token.

Training capture, :class:`~curkv_train.runtime.CurKVCache` (after prefill and at every
re-compression) and :class:`~curkv_train.runtime.CurKVPress` all call :func:`query_features`,
so a scorer sees the same inputs wherever it runs. Per (batch, KV head, token j), from the
layer's :class:`~curkv_train.core.observation.Observation` (the last W tokens' pre-RoPE queries,
and the moments of every query seen):

- ``window_attention``: SnapKV's signal, the attention the window's queries (rotated to their
  own positions, causal) pay token j, averaged over the window, average-pooled over
  ``pool_kernel`` neighbouring tokens, averaged over the KV head's query heads; log(n·p).
- ``expected_attention``: ExpectedAttention's signal, softmax over tokens of
  s·μ'·k_j + ½·s²·k_jᵀΣ'k_j with μ, Σ the mean and covariance of the queries of every token
  seen so far (but the first few, :class:`~curkv_train.core.observation.QueryStatistics`), rotated
  by RoPE averaged over the next ``future_positions`` positions; group-averaged; log(n·p).
- ``value_norm``: log ‖v_j‖.
- ``output_norm``: log ‖W_O v_j‖, averaged over the KV head's query heads (what token j can
  write into the residual stream; KVzip+ and CriticalKV weigh by it).

Each feature is centred over the scored tokens of its (batch, KV head), so a weighted sum of
them is a logit near 0 on average; centring changes no ranking.

The three attention-sized parts (the window rows' attention to every key, the expected
attention's logits, ‖W_O v‖) are computed by the torch functions below or, for CUDA tensors in
eager scoring, by the fused Triton kernels of :mod:`curkv_train.kernels.query_features_triton`
(:func:`feature_backend`); the rest is the same code either way.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from curkv_train.core.observation import Observation, QueryStatistics
from curkv_train.core.rope import average_rotation, fixed_frequencies, rotary_module, rotary_tables, rotate
from curkv_train.core.errors import CurKVError
from curkv_train.kernels.limits import SUPPORTED_DTYPES, tileable_head_dim, triton_available

QUERY_FEATURES = ("window_attention", "expected_attention", "value_norm", "output_norm")
EPSILON = 1e-6
MASKED = -1e30  # an additive mask: exp(MASKED - peak) is 0, and MASKED + a logit is finite
# torch.set_float32_matmul_precision's names: "highest" float32 products, "medium" bfloat16 operands
MATMUL_PRECISIONS = ("highest", "medium")


def query_features(model: PreTrainedModel, module: torch.nn.Module, keys: torch.Tensor, values: torch.Tensor,
                   positions: torch.Tensor, end: int, observation: Observation, *,
                   future_positions: int = 512, pool_kernel: int = 5, gram: torch.Tensor | None = None,
                   rotation: torch.Tensor | None = None, backend: str = "auto",
                   matmul_precision: str = "highest", names: tuple[str, ...] = QUERY_FEATURES,
                   valid: torch.Tensor | None = None) -> torch.Tensor:
    """Features of every token of one layer, :data:`QUERY_FEATURES` in order.

    Args:
        model: the base model (its rotary tables).
        module: the layer's attention module (:func:`~curkv_train.core.observation.attention_module`;
            the module rather than its index, so a compiled scorer runs one graph for every layer).
        keys: (batch, kv_heads, tokens, head_dim) keys as cached (post-RoPE).
        values: (batch, kv_heads, tokens, head_dim) values.
        positions: (tokens,) absolute positions, or (batch, kv_heads, tokens) when each head
            holds its own tokens (a compressed cache).
        end: tokens seen so far (the next query's position).
        observation: the layer's observation (window queries, their positions, query statistics).
        future_positions: positions after ``end`` the RoPE rotation is averaged over.
        pool_kernel: odd width of the window-attention pooling.
        gram: the layer's :func:`output_gram`, for a caller that looked it up already (a compiled scorer
            does, outside its graph: the lookup cannot be traced); default: looked up here.
        rotation: :func:`future_rotation` for ``end``, for a caller that looked it up already (a compiled scorer
            does, outside its graph, as for ``gram``); default: looked up here.
        backend: who computes the attention-sized parts (:func:`feature_backend`): ``torch``, ``triton``
            (the fused kernels of :mod:`curkv_train.kernels.query_features_triton`) or ``auto``.
        matmul_precision: the torch path's three attention-sized products (:func:`product`): ``highest``
            (float32) or ``medium`` (bfloat16 operands, float32 after: faster on a CPU with bf16 instructions,
            the scores rounded slightly differently; docs/runtime.md). The Triton kernels ignore it.
        names: which features, a subset of :data:`QUERY_FEATURES` in its order (:func:`check_feature_names`);
            the torch path computes only those (the window attention is most of the cost, ‖W_O v‖ the next).
        valid: (batch, kv_heads, tokens) bool, False for padding (each head's tokens first, padding after: heads
            of different lengths scored in one pass, or a width padded to a fixed size). Padded tokens get no
            attention share, are left out of the counts and the centring, and leave every real token's features
            what they are without them; theirs are meaningless. ``positions`` must still be valid RoPE positions
            there (say, a real token's repeated).

    Returns:
        (batch, kv_heads, tokens, len(names)) float32.
    """
    check_matmul_precision(matmul_precision)
    check_feature_names(names)
    kernels = feature_backend(backend, keys, values) == "triton"
    parts = _attention_sized_parts(model, module, keys, values, positions, end, observation, future_positions, gram,
                                   rotation, matmul_precision, names, kernels, valid)
    count = keys.shape[2] if valid is None else valid.sum(dim=-1, keepdim=True)  # (b, h, 1): each head's tokens
    features = torch.stack([_finish(name, parts.get(name), values, pool_kernel, valid, count) for name in names],
                           dim=-1)
    if valid is None:
        return features - features.mean(dim=2, keepdim=True)
    weights = valid.unsqueeze(-1).float()
    return features - (features * weights).sum(dim=2, keepdim=True) / count.unsqueeze(-1)


def check_feature_names(names: tuple[str, ...] | list[str]) -> None:
    """A one-line CurKVError unless ``names`` is a non-empty subset of :data:`QUERY_FEATURES`, in its order."""
    unknown = [name for name in names if name not in QUERY_FEATURES]
    if unknown or not names:
        raise CurKVError(f"unknown query features {unknown or 'none given'}; expected a subset of "
                         f"{', '.join(QUERY_FEATURES)}")
    if list(names) != [name for name in QUERY_FEATURES if name in names]:
        raise CurKVError(f"query features {list(names)} must be distinct and in the order {', '.join(QUERY_FEATURES)}")


def _attention_sized_parts(model, module, keys, values, positions, end, observation, future_positions, gram, rotation,
                           precision, names, kernels, valid=None) -> dict[str, torch.Tensor]:
    """What the ``names`` features need, keyed by feature: the window's mass (b, h, n), the expected attention's
    logits (b, h, g, n), ‖W_O v‖ (b, h, n); by the fused Triton kernels (``kernels``: all three in one pass) or
    :func:`window_mass`, :func:`expected_logits` and :func:`output_norms`, only those asked for. Padding (``valid``
    False) is placed at ``end``, after every window query, for the window's mass: none of it reaches padding."""
    names = QUERY_FEATURES if kernels else names  # the kernels' inputs are every part's
    kv_heads, dim = keys.shape[1], keys.shape[3]
    group = observation.queries.shape[1] // kv_heads
    scale = getattr(module, "scaling", dim**-0.5)
    positions, query_positions = positions.to(keys.device), observation.positions.to(keys.device)
    seen_positions = positions if valid is None else torch.where(valid, positions, end)
    if "window_attention" in names:
        queries = window_queries(model, observation.queries.float(), observation.positions, kv_heads, scale)
    if "expected_attention" in names:
        rotation = future_rotation(model, end, future_positions, dim, keys) if rotation is None else rotation
        factors = (1.0, 1.0) if kernels else (scale, 0.5 * scale**2)  # the torch path's logit terms, or the moments
        mean, covariance = future_moments(observation.statistics, rotation, kv_heads, keys, *factors)
    if kernels:
        from curkv_train.kernels.query_features_triton import query_feature_parts_triton

        gram = output_gram(module, kv_heads, group) if gram is None else gram
        parts = query_feature_parts_triton(queries, query_positions, keys, seen_positions, values, mean, covariance,
                                           gram, scale)
        return dict(zip(("window_attention", "expected_attention", "output_norm"), parts))
    float_keys, parts = keys.float(), {}
    if "window_attention" in names:
        parts["window_attention"] = window_mass(queries, float_keys, seen_positions, query_positions, precision)
    if "expected_attention" in names:
        parts["expected_attention"] = expected_logits(mean, covariance, float_keys, precision)
    if "output_norm" in names:
        parts["output_norm"] = output_norms(module, values, group, gram, precision)
    return parts


def _finish(name: str, part: torch.Tensor | None, values: torch.Tensor, pool_kernel: int,
            valid: torch.Tensor | None, count: int | torch.Tensor) -> torch.Tensor:
    """Feature ``name`` (batch, kv_heads, tokens) from its attention-sized part (:func:`_attention_sized_parts`;
    ``value_norm`` has none): the log shares of the two attentions among ``count`` tokens (an int, or (b, h, 1)
    with padding), the log norms. The window's mass is already 0 at padding: its pooling sees zeros there, as past
    the last token."""
    if name == "window_attention":
        return _log_share(F.avg_pool1d(part, pool_kernel, stride=1, padding=pool_kernel // 2), count)
    if name == "expected_attention":
        if valid is not None:
            part = part.masked_fill(~valid.unsqueeze(2), MASKED)
        return _log_share(part.softmax(dim=-1).mean(dim=2), count)
    if name == "value_norm":
        return values.float().norm(dim=-1).clamp_min(EPSILON).log()
    return part.clamp_min(EPSILON).log()


def feature_backend(backend: str, keys: torch.Tensor, values: torch.Tensor) -> str:
    """``torch`` or ``triton`` for :func:`query_features`' attention-sized parts.

    ``auto`` picks the fused Triton kernels for CUDA tensors that need no gradient, outside
    ``torch.compile`` (which fuses the torch path itself), with a head_dim the kernels tile (a power
    of two >= 16) and a dtype they compute in (not float64), and torch otherwise. Unlike the compression kernels, ``auto`` does not pick them
    under ``TRITON_INTERPRET=1``: interpreted, every layer's scoring would take seconds (the kernel
    tests ask for them by name).
    """
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"unknown feature backend {backend!r}; expected auto, torch or triton")
    if backend != "auto":
        return backend
    needs_grad = torch.is_grad_enabled() and (keys.requires_grad or values.requires_grad)
    tileable = tileable_head_dim(keys.shape[-1]) and keys.dtype in SUPPORTED_DTYPES and values.dtype in SUPPORTED_DTYPES
    if keys.is_cuda and tileable and not needs_grad and not torch.compiler.is_compiling() and triton_available():
        return "triton"
    return "torch"


def check_matmul_precision(precision: str) -> None:
    """A one-line CurKVError unless ``precision`` is one of :data:`MATMUL_PRECISIONS`."""
    if precision not in MATMUL_PRECISIONS:
        raise CurKVError(f"unknown matmul precision {precision!r}; expected {' or '.join(MATMUL_PRECISIONS)}")


def product(a: torch.Tensor, b: torch.Tensor, precision: str = "highest") -> torch.Tensor:
    """``a @ b`` in float32; with ``precision="medium"`` from bfloat16 operands, the product also rounded to
    bfloat16 (a CPU's bfloat16 matmul returns bfloat16), then widened. torch.set_float32_matmul_precision("medium")
    rounds only the operands, and only where the hardware has a bfloat16 path; this does it everywhere."""
    if precision == "medium":
        a, b = a.bfloat16(), b.bfloat16()
    out = _matmul(a, b)
    return out.float() if precision == "medium" else out


def _matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b``; two 3-D operands (batch, n, k) and (batch, k, m) go straight to ``torch.bmm``: matmul's general
    path would add batch expands and reshapes around the same product."""
    if a.dim() == 3 and b.dim() == 3 and a.shape[0] == b.shape[0]:
        return torch.bmm(a, b)
    return a @ b


def _log_share(probs: torch.Tensor, count: int | torch.Tensor) -> torch.Tensor:
    """log(n·p) of attention shares p (..., n) among ``count`` = n tokens (an int, or per row (..., 1)): 0 where a
    token gets the uniform share."""
    return (probs * count + EPSILON).log()


def window_queries(model: PreTrainedModel, queries: torch.Tensor, query_positions: torch.Tensor, kv_heads: int,
                   scale: float) -> torch.Tensor:
    """The window's queries rotated to their own positions and scaled, one row per (query head g, query w)
    of each KV head: (batch, kv_heads, g·W, head_dim) from pre-RoPE (batch, heads, W, head_dim)."""
    batch, _, _, dim = queries.shape
    tables = rotary_tables(model, query_positions, queries)
    rotated = rotate(queries, *tables) if tables is not None else queries
    return (rotated * scale).reshape(batch, kv_heads, -1, dim)  # scaled: W·d products, not W·n


def window_mass(queries: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor,
                query_positions: torch.Tensor, precision: str = "highest") -> torch.Tensor:
    """The attention each key gets from the window, averaged over its rows: (batch, kv_heads, tokens).

    Args:
        queries: (batch, kv_heads, g·W, head_dim) :func:`window_queries`; row g·W + w is query head g's query w.
        keys: (batch, kv_heads, tokens, head_dim) float32 post-RoPE keys.
        positions, query_positions: absolute positions of keys ((tokens,) or (batch, kv_heads,
            tokens)) and of the window's W queries (W,); a row sees keys at or before its query's position.
        precision: of the (rows × tokens) logits' product (:func:`product`).
    """
    batch, kv_heads, rows, _ = queries.shape
    window = query_positions.shape[0]
    logits = product(queries, keys.transpose(-1, -2), precision)  # (b, h, g·W, n)
    future = positions.unsqueeze(-2) > query_positions.reshape(-1, 1)  # (W, n) or (b, h, W, n)
    # an additive (W, n) mask broadcast over the g query heads (masked_fill with a broadcast mask, or a (g·W, n)
    # one, takes several times longer); -1e30, not -inf, so that a row seeing no key is a finite softmax, which
    # its weight of 0 then drops: no NaN to clean up (nan_to_num's per-element check cost as much as the softmax)
    logits = logits.view(batch, kv_heads, rows // window, window, -1).add_(
        torch.where(future, MASKED, 0.0).unsqueeze(-3)).view(batch, kv_heads, rows, -1)
    probs = logits.softmax(dim=-1)
    sees_a_key = (positions.amin(dim=-1, keepdim=True) <= query_positions).float() / rows  # (W,) or (b, h, W)
    weight = sees_a_key.expand(batch, kv_heads, window).repeat(1, 1, rows // window)  # (b, h, g·W)
    # the mean over rows as a product with the weights, not a reduction over dim 2 (~1.5x the softmax compiled);
    # taken before the pooling, which is linear too: pooled R times less
    return (weight.unsqueeze(-2) @ probs).squeeze(-2)


# per module, the last result of future_rotation (rotary modules) and output_gram (attention modules): beside the
# model, not on it (a user's model is left as it was)
_future_rotations: weakref.WeakKeyDictionary[torch.nn.Module, tuple] = weakref.WeakKeyDictionary()
_output_grams: weakref.WeakKeyDictionary[torch.nn.Module, tuple] = weakref.WeakKeyDictionary()


@torch.compiler.disable  # a cache lookup, like output_gram: traced, its key would be a guard
def future_rotation(model: PreTrainedModel, end: int, future_positions: int, head_dim: int,
                    like: torch.Tensor) -> torch.Tensor:
    """(head_dim, head_dim) RoPE averaged over [end, end + future_positions) (:func:`~curkv_train.core.rope.
    average_rotation`), kept per rotary module for the last ``end`` asked: every layer of a compression round asks
    for the same one."""
    rotary = rotary_module(model)
    if rotary is None:
        return average_rotation(model, end, future_positions, head_dim, like)
    frequencies, _ = fixed_frequencies(rotary)
    key = (end, future_positions, head_dim, like.device, frequencies.data_ptr(), frequencies._version)
    cached = _future_rotations.get(rotary)
    if cached is None or cached[0] != key:
        cached = (key, average_rotation(model, end, future_positions, head_dim, like))
        _future_rotations[rotary] = cached
    return cached[1]


def future_moments(statistics: QueryStatistics, rotation: torch.Tensor, kv_heads: int, keys: torch.Tensor,
                   linear: float = 1.0, quadratic: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The queries' mean (batch, kv_heads, g, head_dim) and covariance (batch, kv_heads, g, head_dim, head_dim)
    rotated by ``rotation`` (head_dim, head_dim), RoPE averaged over the coming positions
    (:func:`future_rotation`): the Gaussian future query of each query head. Scaled by ``linear`` and
    ``quadratic`` (:meth:`QueryStatistics.moments`: at no cost), e.g. s and ½·s² for :func:`expected_logits`."""
    batch, dim = keys.shape[0], keys.shape[3]
    mean, covariance = statistics.moments(linear, quadratic)
    covariance = covariance.view(-1, dim, dim)  # products of 2-D and 3-D views: no broadcasting's reshapes
    rotation_t = rotation.T
    turned = torch.bmm(rotation.expand_as(covariance), covariance).view(-1, dim) @ rotation_t
    return (mean.view(-1, dim) @ rotation_t).view(batch, kv_heads, -1, dim), turned.view(batch, kv_heads, -1, dim, dim)


def expected_logits(linear: torch.Tensor, quadratic: torch.Tensor, keys: torch.Tensor,
                    precision: str = "highest") -> torch.Tensor:
    """linear·k_j + k_jᵀ·quadratic·k_j for every query head's terms and key: (batch, kv_heads, g, tokens), a
    transposed view; with the terms s·μ' and ½·s²·Σ' of a Gaussian future query (:func:`future_moments`), its
    softmax over tokens is the expected attention.

    Args:
        linear: (batch, kv_heads, g, head_dim).
        quadratic: (batch, kv_heads, g, head_dim, head_dim), symmetric.
        keys: (batch, kv_heads, tokens, head_dim) float32 post-RoPE keys.
        precision: of the two products with the keys (:func:`product`); the dots are float32.

    One product of the keys with the KV head's g matrices side by side, then per key a (1 × head_dim) by
    (head_dim × g) dot with its g rows, the linear term (a product of the keys with the g vectors) added in it:
    broadcasting the keys into the product instead copied them g times, and a separate sum cost a pass over it."""
    batch, kv_heads, group, dim = linear.shape
    rows = batch * kv_heads * keys.shape[2]
    per_head = keys.reshape(batch * kv_heads, -1, dim)  # 3-D products: no broadcasting's reshapes
    stacked = quadratic.reshape(batch * kv_heads, group * dim, dim).transpose(1, 2)  # block g: quadraticᵀ = itself
    projected = product(per_head, stacked, precision).view(rows, group, dim)
    if torch.compiler.is_compiling():  # the compiler fuses the linear term and the dot into one pass over the product
        heads = batch * kv_heads
        terms = (projected.view(heads, -1, group, dim) + linear.reshape(heads, 1, group, dim)) * per_head.unsqueeze(2)
        return terms.sum(-1).view(batch, kv_heads, -1, group).transpose(2, 3)
    linear_terms = product(per_head, linear.reshape(batch * kv_heads, group, dim).transpose(1, 2), precision)
    terms = torch.baddbmm(linear_terms.view(rows, 1, group), per_head.reshape(rows, 1, dim), projected.transpose(1, 2))
    return terms.view(batch, kv_heads, -1, group).transpose(2, 3)


def output_norms(module: torch.nn.Module, values: torch.Tensor, group: int,
                 gram: torch.Tensor | None = None, precision: str = "highest") -> torch.Tensor:
    """‖W_O v_j‖ averaged over the KV head's query heads: (batch, kv_heads, tokens).

    Args:
        module: the attention module (its ``o_proj`` maps heads × head_dim to hidden_size).
        values: (batch, kv_heads, tokens, head_dim).
        group: query heads per KV head.
        gram: ``module``'s :func:`output_gram` if the caller has it.
        precision: of the (tokens × group·head_dim) product (:func:`product`).
    """
    return head_output_norms(module, values, group, gram, precision).mean(dim=2)


def head_output_norms(module: torch.nn.Module, values: torch.Tensor, group: int,
                      gram: torch.Tensor | None = None, precision: str = "highest") -> torch.Tensor:
    """‖W_O^(h,g) v_j‖ for every query head g of each KV head h: (batch, kv_heads, group, tokens).

    W_O^(h,g) is the slice of ``o_proj`` that reads query head h·group + g, so this is the size
    of what token j writes into the residual stream through that head when fully attended.
    ``gram``: ``module``'s :func:`output_gram` if the caller has it (default: looked up); ``precision``: of
    the product with it (:func:`product`).
    """
    batch, kv_heads, tokens, dim = values.shape
    gram = output_gram(module, kv_heads, group) if gram is None else gram
    values = values.float()
    stacked = gram.permute(0, 2, 1, 3).reshape(kv_heads, dim, group * dim)
    projected = product(values, stacked, precision)  # (b, h, n, g·d)
    squared = (projected.reshape(batch, kv_heads, tokens, group, dim) * values[:, :, :, None]).sum(dim=-1)
    return squared.clamp_min(0).sqrt().transpose(2, 3)


@torch.compiler.disable  # a cache lookup: traced, its key would be a guard, and every layer a recompilation
def output_gram(module: torch.nn.Module, kv_heads: int, group: int) -> torch.Tensor:
    """W_O^(h,g)ᵀ·W_O^(h,g) for every (KV head h, query head g): (kv_heads, group, head_dim, head_dim) float32.

    Kept per module while it lives (the base is frozen), recomputed if ``o_proj``'s weight is replaced or changed.
    """
    weight = module.o_proj.weight
    key = (weight.data_ptr(), weight._version, kv_heads, group)
    cached = _output_grams.get(module)
    if cached is None or cached[0] != key:
        heads = weight.detach().float().reshape(weight.shape[0], kv_heads, group, -1)  # (hidden, h, g, d)
        cached = (key, torch.einsum("ohgd,ohge->hgde", heads, heads))
        _output_grams[module] = cached
    return cached[1]
