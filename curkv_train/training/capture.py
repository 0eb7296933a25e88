"""Capture: prefill the context once without grad and keep what the estimator and the objective read.

The frozen model runs over the context once; the capture keeps its cache (post-RoPE keys and
values, reused by the teacher, the student and the reconstruction pass), the keys as projected
(pre-RoPE, after ``k_norm`` where the model normalises keys) and, when the
estimator family needs them, every layer's attention inputs of every context token (the
``query_aware`` family reads the observation window and the statistics of all queries, the
``hidden`` family each token's hidden state). :func:`estimator_inputs`
turns a capture into the estimator's :class:`~curkv_train.models.seed_estimator.EstimatorInputs`
through the same feature function the runtime uses.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import DynamicCache, PreTrainedModel

from curkv_train.training.scored_attention import CompressionState
from curkv_train.core.observation import (HiddenRecorder, Observation, attention_module, attention_modules,
                                          observe_queries, pre_rope_queries, removed_after)
from curkv_train.core.rope import key_view
from curkv_train.models.seed_estimator import EstimatorInputs


@dataclass
class ContextCapture:
    """The prefilled context of a batch.

    Attributes:
        context_ids: (batch, context) the context's token ids.
        cache: the base model's cache after the context (post-RoPE keys), cropped back to the
            context after every pass that extends it.
        values: (layers, batch, kv_heads, context, head_dim) float32 values.
        pre_rope_keys: (layers, batch, kv_heads, context, head_dim) float32 keys before RoPE, as the
            model projected (and normalised) them, or None when not recorded.
        hidden: per layer, (batch, context, hidden_size) attention inputs, or None when not recorded.
    """

    context_ids: torch.Tensor
    cache: DynamicCache
    values: torch.Tensor
    pre_rope_keys: torch.Tensor | None = None
    hidden: list[torch.Tensor] | None = None
    _queries: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    @property
    def context_length(self) -> int:
        """Number of context tokens."""
        return self.context_ids.shape[1]

    @property
    def positions(self) -> torch.Tensor:
        """(context,) absolute positions of the context tokens."""
        return torch.arange(self.context_length, device=self.context_ids.device)

    def cached_keys(self, layer: int) -> torch.Tensor:
        """(batch, kv_heads, context, head_dim) post-RoPE keys of ``layer``, as cached."""
        return self.cache.layers[layer].keys[:, :, : self.context_length]

    def observation(self, model: PreTrainedModel, layer: int, end: int, skip: int) -> Observation:
        """What a query-aware scorer at position ``end`` reads of ``layer``: the queries before ``end``
        and their statistics from position ``skip`` on (as the runtime accumulates them)."""
        if layer not in self._queries:
            self._queries[layer] = pre_rope_queries(attention_module(model, layer), self.hidden[layer]).float()
        return observe_queries(self._queries[layer][:, :, :end], skip)


class KeyRecorder:
    """Records every layer's pre-RoPE keys during the forward passes inside :meth:`recording`.

    A forward hook on each ``k_proj`` keeps its output; :meth:`layers` applies the module's ``k_norm``
    (Qwen3, Gemma 3) to it, per head vector, so the keys are those RoPE rotates, whatever layout the
    model's own forward normalises them in.
    """

    def __init__(self) -> None:
        self.projected: dict[int, torch.Tensor] = {}
        self.modules: dict[int, nn.Module] = {}

    def _record(self, attention: nn.Module, projection: nn.Module, args: tuple, output: torch.Tensor) -> None:
        self.projected[attention.layer_idx] = output.detach()
        self.modules[attention.layer_idx] = attention

    @contextmanager
    def recording(self, model: PreTrainedModel) -> Iterator["KeyRecorder"]:
        """Record while the block runs (forward hooks on every key projection, removed after)."""
        with removed_after([module.k_proj.register_forward_hook(functools.partial(self._record, module))
                            for module in attention_modules(model)]):
            yield self

    def layers(self) -> torch.Tensor:
        """(layers, batch, kv_heads, tokens, head_dim) float32 pre-RoPE keys of the recorded pass."""
        return torch.stack([self.layer(index) for index in sorted(self.projected)])

    def layer(self, index: int) -> torch.Tensor:
        """(batch, kv_heads, tokens, head_dim) float32 pre-RoPE keys of layer ``index``."""
        module, projected = self.modules[index], self.projected[index]
        keys = projected.view(*projected.shape[:2], -1, module.head_dim)
        k_norm = getattr(module, "k_norm", None)
        return (k_norm(keys) if k_norm is not None else keys).transpose(1, 2).float()


@torch.no_grad()
def prefill_context(model: PreTrainedModel, context_ids: torch.Tensor, record_hidden: bool = False,
                    record_keys: bool = True) -> ContextCapture:
    """Run the frozen model over ``context_ids`` (batch, context) once and keep its K/V (and pre-RoPE keys).

    Every layer's cache keeps the whole context, sliding-window layers' too (their own cache would drop
    its oldest tokens and could not be cropped back after a continuation); the sliding layers' masks
    still show each query only its window, so every pass attends as the plain model does.

    Args:
        record_hidden: also keep every layer's attention inputs.
        record_keys: also keep every layer's pre-RoPE keys (what the ``pre_rope`` key view reads).
    """
    cache = DynamicCache()
    hidden_recorder, key_recorder = HiddenRecorder(), KeyRecorder()
    with (hidden_recorder.recording(model) if record_hidden else nullcontext(),
          key_recorder.recording(model) if record_keys else nullcontext()):
        model.get_decoder()(input_ids=context_ids, past_key_values=cache, use_cache=True,
                            curkv_state=CompressionState(mode="full"))
    values = torch.stack([layer.values.float() for layer in cache.layers])
    hidden = hidden_recorder.layers() if record_hidden else None
    keys = key_recorder.layers() if record_keys else None
    return ContextCapture(context_ids=context_ids, cache=cache, values=values, pre_rope_keys=keys, hidden=hidden)


def continue_from(model: PreTrainedModel, capture: ContextCapture, continuation_ids: torch.Tensor,
                  state: CompressionState) -> torch.Tensor:
    """Last hidden states (batch, M, hidden) of the continuation over the captured context.

    The cache is cropped back to the context afterwards, so the same capture serves
    the teacher, the student and the reconstruction pass.
    """
    try:
        output = model.get_decoder()(
            input_ids=continuation_ids, past_key_values=capture.cache, use_cache=True, curkv_state=state
        )
    finally:
        capture.cache.crop(capture.context_length)
    return output.last_hidden_state


@torch.no_grad()
def reconstruction_target(model: PreTrainedModel, capture: ContextCapture, prompt_ids: torch.Tensor,
                          backend: str = "auto") -> torch.Tensor:
    """KVzip+ scores of every context token while the model repeats the context after ``prompt_ids``.

    Args:
        prompt_ids: (prompt,) token ids of the repeat instruction.

    Returns:
        (full layers, batch, kv_heads, context) float32, one row per full-attention layer in layer order
        (:func:`~curkv_train.training.scored_attention.full_attention_layers`; sliding-window layers are
        never compressed and get no target); see :mod:`curkv_train.training.reconstruction`.
    """
    batch = capture.context_ids.shape[0]
    ids = torch.cat([prompt_ids.to(capture.context_ids.device).expand(batch, -1), capture.context_ids], dim=1)
    state = CompressionState("reconstruct", capture.context_length, backend=backend)
    continue_from(model, capture, ids, state)
    return torch.stack([state.reconstruction[layer] for layer in sorted(state.reconstruction)])


def estimator_inputs(model: PreTrainedModel, estimator: nn.Module, capture: ContextCapture, view: str,
                     end: int | None = None) -> EstimatorInputs:
    """The estimator's inputs for the first ``end`` context tokens (all by default), every layer.

    Query features (no grad) come from the estimator's own :meth:`query_features`, the function
    the runtime calls; per-token scores of the ``hidden`` family are computed here with grad.
    """
    end = capture.context_length if end is None else end
    positions = capture.positions[:end]
    layers = range(capture.values.shape[0])
    keys = [capture.cached_keys(layer)[:, :, :end] for layer in layers]
    values = capture.values[:, :, :, :end]
    features = token_scores = None
    if "query_features" in estimator.needs:
        with torch.no_grad():
            features = torch.stack([
                estimator.query_features(model, attention_module(model, layer), keys[layer], values[layer],
                                         positions, end, capture.observation(model, layer, end,
                                                                             estimator.statistics_skip))
                for layer in layers])
    if "token_scores" in estimator.needs:
        hidden = torch.stack([capture.hidden[layer][:, :end] for layer in layers])
        token_scores = estimator.token_scores(hidden)
    if view == "pre_rope" and capture.pre_rope_keys is not None:  # as projected: no RoPE table to invert
        viewed = capture.pre_rope_keys[:, :, :, :end]
    else:
        viewed = torch.stack([key_view(model, keys[layer], positions, view, end) for layer in layers])
    return EstimatorInputs(viewed, values, positions, end, query_features=features, token_scores=token_scores)
