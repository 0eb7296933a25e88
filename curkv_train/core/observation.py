"""The attention inputs a scorer reads besides K and V: queries of the observation window, hidden states.

Every decoder attention module of a Llama/Mistral/Qwen-style model receives its input hidden
states (after the layer norm) as ``hidden_states``. From them the module's own projections give
the pre-RoPE queries (:func:`pre_rope_queries`), so a scorer that needs "the queries of the last
W tokens" can be fed the last W hidden states — the same thing a kvpress press receives, and
what the runtime cache records as tokens arrive.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel


@dataclass
class Observation:
    """One layer's observation window.

    Attributes:
        hidden: (batch, W, hidden_size) attention inputs of the last W tokens seen.
        positions: (W,) their absolute positions.
    """

    hidden: torch.Tensor
    positions: torch.Tensor

    def last(self, count: int) -> "Observation":
        """The window cut to its last ``count`` tokens."""
        return Observation(self.hidden[:, -count:], self.positions[-count:])


def attention_modules(model: PreTrainedModel) -> list[torch.nn.Module]:
    """The attention module of every decoder layer, in layer order."""
    return [layer.self_attn for layer in model.get_decoder().layers]


def attention_module(model: PreTrainedModel, layer: int) -> torch.nn.Module:
    """The attention module of decoder layer ``layer``."""
    return model.get_decoder().layers[layer].self_attn


def pre_rope_queries(module: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """(batch, heads, tokens, head_dim) queries of a Llama-style attention module before RoPE.

    Args:
        module: the attention module (``q_proj``, ``head_dim``, optional ``q_norm``).
        hidden: (batch, tokens, hidden_size) its input hidden states.
    """
    batch, tokens, _ = hidden.shape
    weight = module.q_proj.weight
    queries = module.q_proj(hidden.to(weight.dtype)).view(batch, tokens, -1, module.head_dim).transpose(1, 2)
    q_norm = getattr(module, "q_norm", None)  # Qwen3 / Gemma3 normalise queries before RoPE
    return q_norm(queries) if q_norm is not None else queries


class HiddenRecorder:
    """Records the attention inputs of every layer during the forward passes inside :meth:`recording`.

    Args:
        keep_last: keep only the last ``keep_last`` tokens of each pass (None = all).
    """

    def __init__(self, keep_last: int | None = None) -> None:
        self.keep_last = keep_last
        self.hidden: dict[int, torch.Tensor] = {}

    def _record(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        self.hidden[module.layer_idx] = (hidden if self.keep_last is None else hidden[:, -self.keep_last:]).detach()

    @contextmanager
    def recording(self, model: PreTrainedModel) -> Iterator["HiddenRecorder"]:
        """Record while the block runs (forward pre-hooks on every attention module, removed after)."""
        hooks = [module.register_forward_pre_hook(self._record, with_kwargs=True)
                 for module in attention_modules(model)]
        try:
            yield self
        finally:
            for hook in hooks:
                hook.remove()

    def layers(self) -> list[torch.Tensor]:
        """Recorded hidden states per layer, (batch, tokens, hidden_size) each."""
        return [self.hidden[index] for index in sorted(self.hidden)]
