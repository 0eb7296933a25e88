"""The ``hidden`` family: a KVzap-like MLP on each token's attention input (arXiv 2601.07891).

    z_{l,h,j} = mlp_l(x_j)[h]

with x_j the hidden state layer l's attention received for token j (after the layer norm).
A token's logit depends on nothing else, so the runtime computes it once, when the token
arrives (:meth:`HiddenStateEstimator.token_scores`), and keeps it with the token.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from curkv_train.models.seed_estimator import EstimatorInputs, init_bias


class HiddenStateEstimator(nn.Module):
    """Per-layer MLP hidden_size -> hidden_units -> kv_heads (GELU) on the attention inputs.

    Args:
        num_layers: decoder layers of the base model.
        num_kv_heads: KV heads per layer.
        head_dim: key/value width per head (recorded for the model check; unused by the MLP).
        hidden_size: width of the attention inputs.
        hidden_units: width of the MLP's hidden layer.
        init_keep: initial keep score, sets the output bias to logit(init_keep).
    """

    family = "hidden"
    needs = frozenset({"token_scores"})

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, hidden_size: int,
                 hidden_units: int = 64, init_keep: float = 0.5) -> None:
        super().__init__()
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.hidden_size, self.hidden_units, self.init_keep = hidden_size, hidden_units, init_keep
        self.input_weight = nn.Parameter(torch.randn(num_layers, hidden_size, hidden_units) / math.sqrt(hidden_size))
        self.input_bias = nn.Parameter(torch.zeros(num_layers, hidden_units))
        self.output_weight = nn.Parameter(torch.randn(num_layers, hidden_units, num_kv_heads)
                                          / math.sqrt(hidden_units) * 0.1)
        self.bias = init_bias((num_layers, num_kv_heads), init_keep)

    def config(self) -> dict:
        """Constructor arguments, enough to rebuild this estimator."""
        return {"num_layers": self.num_layers, "num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim,
                "hidden_size": self.hidden_size, "hidden_units": self.hidden_units, "init_keep": self.init_keep}

    def activation_floats(self) -> int:
        """float32 values kept for the backward per (layer, KV head, token): the MLP's hidden units, shared by the heads."""
        return -(-self.hidden_units // self.num_kv_heads) + 1

    def token_scores(self, hidden: torch.Tensor, layers: torch.Tensor | slice = slice(None)) -> torch.Tensor:
        """Per-token logits from attention inputs.

        Args:
            hidden: (L', batch, tokens, hidden_size) attention inputs of the L' ``layers``.

        Returns:
            (L', batch, kv_heads, tokens) float32.
        """
        inner = torch.einsum("lbnx,lxu->lbnu", hidden.float(), self.input_weight[layers])
        inner = nn.functional.gelu(inner + self.input_bias[layers][:, None, None, :])
        scores = torch.einsum("lbnu,luh->lbhn", inner, self.output_weight[layers])
        return scores + self.bias[layers][:, None, :, None]

    def forward(self, inputs: EstimatorInputs, layers: torch.Tensor | slice = slice(None)) -> torch.Tensor:
        """Keep-score logits (L', batch, kv_heads, tokens): the stored ``inputs.token_scores``."""
        if inputs.token_scores is None:
            raise ValueError("the hidden estimator needs token_scores (its token_scores of each token's hidden state)")
        return inputs.token_scores.float()
