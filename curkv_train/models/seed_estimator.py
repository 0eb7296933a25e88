"""The seed value estimator and the inputs every estimator family shares.

Per layer l and KV head h, for context token j with key k_j, value v_j and
position features p_j (DESIGN.md §3)::

    z_j = a_{l,h}·k_j / sqrt(d) + w_{l,h}·φ(p_j) + mlp_{l,h}(v_j) + b_{l,h}
    s_j = σ(z_j / T)

Parameters are stacked over (layer, KV head) so each term is one batched product. Other families
(:mod:`curkv_train.models.families`) take the same :class:`EstimatorInputs`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

NUM_POSITION_FEATURES = 8


@dataclass
class EstimatorInputs:
    """What an estimator scores, batched over L' layers.

    Attributes:
        keys: (L', batch, kv_heads, tokens, head_dim) keys in the estimator's key view.
        values: (L', batch, kv_heads, tokens, head_dim) values.
        positions: (tokens,) absolute positions, or (batch, kv_heads, tokens) when each head
            holds its own tokens (a compressed cache).
        end: tokens seen so far (distance features are measured to it); a 0-d tensor where the scoring runs
            in a CUDA graph (:meth:`~curkv_train.runtime.Scorer.graphed`), which an int changing every
            compression would re-record.
        query_features: (L', batch, kv_heads, tokens, F) from
            :func:`curkv_train.core.features.query_features`, for families that need them.
        token_scores: (L', batch, kv_heads, tokens) per-token logits computed from each token's
            hidden state when it arrived (the ``hidden`` family), for families that need them.
    """

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    end: int | torch.Tensor
    query_features: torch.Tensor | None = None
    token_scores: torch.Tensor | None = None


def position_features(positions: torch.Tensor, end: int, max_positions: int) -> torch.Tensor:
    """Scalar-term features of where a token sits relative to the end of the context.

    Args:
        positions: (tokens,) or (batch, kv_heads, tokens) absolute positions of the cached tokens.
        end: length of the sequence so far (the next query's position).
        max_positions: the base model's maximum positions, for scaling.

    Returns:
        (*positions.shape, NUM_POSITION_FEATURES) float32: log-scaled distance to the end, its
        square, relative position j/n, its square, and sin/cos of the log distance at
        two frequencies.
    """
    positions = positions.float()
    distance = (end - 1 - positions).clamp_min(0)
    log_distance = torch.log1p(distance) / math.log1p(max_positions)
    relative = positions / (end.clamp_min(1) if isinstance(end, torch.Tensor) else max(end, 1))
    angle = math.pi * log_distance
    return torch.stack(
        [log_distance, log_distance**2, relative, relative**2,
         torch.sin(angle), torch.cos(angle), torch.sin(2 * angle), torch.cos(2 * angle)],
        dim=-1,
    )


def per_head_batches(tensor: torch.Tensor) -> torch.Tensor:
    """(L', batch, kv_heads, rows, cols) -> (L'·batch·kv_heads, rows, cols), a view where the strides allow."""
    return tensor.reshape(-1, *tensor.shape[-2:])


def per_batch(weight: torch.Tensor, batch: int) -> torch.Tensor:
    """A per-(layer, KV head) parameter (L', kv_heads, *rest) repeated for each batch row and flattened like
    :func:`per_head_batches`: (L'·batch·kv_heads, *rest); a view for one batch row."""
    if batch == 1:  # one operator, not three: at inference, layer by layer, each costs as much as a small product
        return weight.flatten(0, 1)
    return weight.unsqueeze(1).expand(weight.shape[0], batch, *weight.shape[1:]).reshape(-1, *weight.shape[2:])


def per_batch_rows(weight: torch.Tensor, batch: int) -> torch.Tensor:
    """:func:`per_batch` with a one-row dimension before the last: (L', kv_heads, d) -> (L'·batch·kv_heads, 1, d),
    the left side of a batched product or the bias of one; a single view for one batch row."""
    if batch == 1:
        return weight.reshape(-1, 1, weight.shape[-1])
    return per_batch(weight, batch).view(-1, 1, weight.shape[-1])


def per_head_affine(inputs: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Each (layer, KV head)'s own affine map: inputs (L', batch, kv_heads, tokens, d) by weight (L', kv_heads, d, k)
    plus bias (L', kv_heads, k) -> (L', batch, kv_heads, tokens, k). One batched product with the bias added in it."""
    if torch.compiler.is_compiling():  # the compiler fuses a product and a sum it sees apart, not a baddbmm
        return inputs @ weight.unsqueeze(1) + bias[:, None, :, None, :]
    batch = inputs.shape[1]
    out = torch.baddbmm(per_batch_rows(bias, batch), per_head_batches(inputs),
                        per_batch(weight, batch))
    return out.view(*inputs.shape[:-1], weight.shape[-1])


def per_head_dot(inputs: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """bias + scale·(weight · inputs) with each (layer, KV head)'s own weight vector and bias: inputs
    (L', batch, kv_heads, tokens, d), weight (L', kv_heads, d), bias (L', kv_heads) -> (L', batch, kv_heads, tokens).
    One batched product, weight-row × inputsᵀ (a product with a one-column right side is slower)."""
    if torch.compiler.is_compiling():  # as in per_head_affine
        return scale * head_dots(inputs, weight) + bias[:, None, :, None]
    batch = inputs.shape[1]
    rows = per_batch_rows(weight, batch)
    biases = bias.reshape(-1, 1, 1) if batch == 1 else per_batch(bias, batch).view(-1, 1, 1)
    out = torch.baddbmm(biases, rows, per_head_batches(inputs).transpose(-1, -2),
                        alpha=scale)
    return out.view(inputs.shape[:-1])


def add_per_head_dot_(total: torch.Tensor, inputs: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``total`` (L', batch, kv_heads, tokens) += weight · inputs, in place, as :func:`per_head_dot` without a bias:
    the product and the sum in one operator. Returns ``total`` (compiled: a new tensor)."""
    if torch.compiler.is_compiling():  # as in per_head_affine
        return total + head_dots(inputs, weight)
    rows = per_batch_rows(weight, inputs.shape[1])
    total.view(-1, 1, total.shape[-1]).baddbmm_(rows, per_head_batches(inputs).transpose(-1, -2))
    return total


def head_dots(inputs: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """weight · inputs per (layer, KV head), (L', batch, kv_heads, tokens), as a broadcast product: the form a compiled
    scorer fuses with the sums around it."""
    return (weight[:, None, :, None, :] @ inputs.transpose(-1, -2)).squeeze(-2)


def init_bias(shape: tuple[int, ...], init_keep: float) -> nn.Parameter:
    """A bias of ``shape`` at logit(init_keep); ``init_keep`` must lie in (0, 1)."""
    if not 0.0 < init_keep < 1.0:
        raise ValueError(f"init_keep must be in (0, 1), got {init_keep}")
    return nn.Parameter(torch.full(shape, math.log(init_keep / (1 - init_keep))))


class ValueEstimator(nn.Module):
    """The ``seed`` family: keep-score logits from each token's key, value and position.

    Args:
        num_layers: decoder layers of the base model.
        num_kv_heads: KV heads per layer.
        head_dim: key/value width per head.
        hidden_divisor: the value MLP is d -> d / hidden_divisor -> 1.
        max_positions: the base model's maximum positions (scales position features).
        init_keep: initial keep score of every token, sets the bias to logit(init_keep).
    """

    family = "seed"
    needs: frozenset[str] = frozenset()

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, hidden_divisor: int = 4,
                 max_positions: int = 8192, init_keep: float = 0.5) -> None:
        super().__init__()
        hidden = max(1, head_dim // hidden_divisor)
        shape = (num_layers, num_kv_heads)
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.hidden_divisor, self.max_positions, self.init_keep = hidden_divisor, max_positions, init_keep
        self.key_weight = nn.Parameter(torch.zeros(*shape, head_dim))
        self.position_weight = nn.Parameter(torch.zeros(*shape, NUM_POSITION_FEATURES))
        self.value_in = nn.Parameter(torch.randn(*shape, head_dim, hidden) / math.sqrt(head_dim))
        self.value_in_bias = nn.Parameter(torch.zeros(*shape, hidden))
        self.value_out = nn.Parameter(torch.randn(*shape, hidden) / math.sqrt(hidden) * 0.1)
        self.bias = init_bias(shape, init_keep)

    def config(self) -> dict:
        """Constructor arguments, enough to rebuild this estimator."""
        return {"num_layers": self.num_layers, "num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim,
                "hidden_divisor": self.hidden_divisor, "max_positions": self.max_positions,
                "init_keep": self.init_keep}

    def activation_floats(self) -> int:
        """float32 values kept for the backward per (layer, KV head, token): the value MLP's hidden units + 2."""
        return self.value_in.shape[-1] + 2

    def position_features(self, positions: torch.Tensor, end: int) -> torch.Tensor:
        """:func:`position_features` of ``positions`` (every one below ``end``), (*positions.shape, F): in eager
        mode, rows of the table of positions 0 .. end - 1 (:meth:`position_table`), gathered."""
        if torch.compiler.is_compiling():  # the compiler fuses the operators; a lookup would break its graph
            return position_features(positions, end, self.max_positions)
        table = self.position_table(end, positions.device)
        return table.index_select(0, positions.reshape(-1)).view(*positions.shape, table.shape[-1])

    @torch.compiler.disable  # a cache lookup: traced, its key would be a guard
    def position_table(self, end: int, device: torch.device) -> torch.Tensor:
        """(end, F) :func:`position_features` of positions 0 .. end - 1, kept for the last ``end`` asked: every layer
        of a compression round, and every step of a training stage, asks for the same (its fourteen small
        operators cost as much as the value MLP, layer by layer)."""
        cached = getattr(self, "_position_table", None)
        if cached is None or cached[0] != (end, device):
            positions = torch.arange(end, device=device)
            cached = ((end, device), position_features(positions, end, self.max_positions))
            self._position_table = cached
        return cached[1]

    def seed_terms(self, inputs: EstimatorInputs, layers: torch.Tensor | slice) -> torch.Tensor:
        """a·k/√d + w·φ(p) + mlp(v) + b: (L', batch, kv_heads, tokens) float32, each term added by the product that
        computes it (layer by layer at inference, the operators' count is most of the cost)."""
        keys, values = inputs.keys.float(), inputs.values.float()
        logits = per_head_dot(keys, self.key_weight[layers], self.bias[layers], scale=self.head_dim**-0.5)
        hidden = per_head_affine(values, self.value_in[layers], self.value_in_bias[layers])
        logits = add_per_head_dot_(logits, torch.relu_(hidden), self.value_out[layers])
        features = self.position_features(inputs.positions.to(keys.device), inputs.end)  # (n, F) or (b, h, n, F)
        features = features.expand(*keys.shape[:3], *features.shape[-2:])
        return add_per_head_dot_(logits, features, self.position_weight[layers])

    def forward(self, inputs: EstimatorInputs, layers: torch.Tensor | slice = slice(None)) -> torch.Tensor:
        """Keep-score logits z: (L', batch, kv_heads, tokens) float32 (``layers`` picks the L' layers)."""
        return self.seed_terms(inputs, layers)
