"""The harness's two kvpress presses: every baseline's selection, and H2O (kvpress has none); needs kvpress."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from kvpress.presses.scorer_press import ScorerPress
from torch import nn
from transformers import PreTrainedModel

from curkv_train.core.errors import CurKVError
from curkv_train.core.selection import compressible_mask


@dataclass
class ProtectedPress(ScorerPress):
    """kvpress's ``press``, its first ``n_sink`` and last ``window`` tokens kept whatever their score.

    The protected tokens score above every other, so kvpress's top-k keeps them and then the best-scored of
    the rest: the selection of :class:`~curkv_train.runtime.press.CurKVPress`, over ``press``'s scores.
    """

    press: ScorerPress | None = None
    n_sink: int = 4
    window: int = 64

    def post_init_from_model(self, model: PreTrainedModel) -> None:
        """The wrapped press's model-dependent setup."""
        self.press.post_init_from_model(model)

    def score(self, module: nn.Module, hidden_states: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
              attentions: torch.Tensor | None, kwargs: dict) -> torch.Tensor:
        """(batch, kv_heads, tokens) the wrapped press's scores, the protected tokens lifted above the maximum, from
        ``hidden_states`` (batch, tokens, hidden_size), ``keys``/``values`` (batch, kv_heads, tokens, head_dim) and,
        under eager attention, ``attentions`` (batch, heads, tokens, tokens)."""
        self.press.compression_ratio = self.compression_ratio  # StreamingLLMPress sizes its scores by its own ratio
        scores = self.press.score(module, hidden_states, keys, values, attentions, kwargs)
        protected = ~compressible_mask(keys.shape[2], self.n_sink, self.window, device=scores.device)
        return torch.where(protected, scores.amax(dim=-1, keepdim=True) + 1, scores)


@dataclass
class H2OPress(ScorerPress):
    """H2O: keep the heavy hitters, the keys that received the most attention (https://arxiv.org/abs/2306.14048).

    The attention each key received, summed over every query of the prefill (the paper's accumulated
    sum), averaged over the KV head's query heads; kvpress's ObservedAttentionPress divides each sum by
    the number of queries that saw the key instead. Needs eager attention (kvpress then hands the weights).
    """

    def score(self, module: nn.Module, hidden_states: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
              attentions: torch.Tensor | None, kwargs: dict) -> torch.Tensor:
        """(batch, kv_heads, tokens) accumulated attention, from ``attentions`` (batch, heads, tokens, tokens)."""
        if attentions is None:
            raise CurKVError("H2OPress reads the prefill's attention weights: run the prefill with eager attention "
                             "(model.set_attn_implementation('eager'))")
        batch, kv_heads, tokens = keys.shape[:3]
        return attentions.float().sum(dim=2).view(batch, kv_heads, -1, tokens).mean(dim=2)
