"""kvpress adapter: the trained value estimator as a kvpress ``ScorerPress``.

Needs the optional ``kvpress`` package (``pip install curkv-train[kvpress]``).
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field, replace

import torch
from kvpress.presses.scorer_press import ScorerPress
from torch import nn
from transformers import PreTrainedModel

from curkv_train.core.errors import CurKVError
from curkv_train.core.features import check_matmul_precision
from curkv_train.core.observation import attention_modules
from curkv_train.core.selection import compressible_mask
from curkv_train.runtime.allocation import LayerBudget, check_layer_budget_choice, resolve_layer_budget
from curkv_train.runtime.attention import install_runtime_attention
from curkv_train.runtime.hybrid import sliding_layers
from curkv_train.runtime.scorer import Scorer
from curkv_train.runtime.serialization import load_scorer

_ABSENT = object()

# Added to the scores of sinks and the recent window: far above any estimator logit,
# finite so that top-k never meets inf - inf.
PROTECTED_SCORE = 1e4


@dataclass
class CurKVPress(ScorerPress):
    """Keep the tokens a trained value estimator scores highest (curkv-train's scorer).

    The estimator scores every cached (layer, KV head, token) with the same function as
    training and :class:`~curkv_train.runtime.CurKVCache` (docs/design.md): from keys, values
    and positions, plus the last hidden states kvpress hands the press (``query_aware``) or
    each token's hidden state (``hidden``). The first ``n_sink`` and the last ``window``
    tokens get a score far above the rest so kvpress keeps them.

    The model is touched only while the press is in use: inside ``with press(model):`` (kvpress's
    context manager, which its pipeline enters) and, under a layer budget, while a cache the press
    compressed lives. On exit, also after an exception, kvpress's hooks and the ``rotary_emb``
    references kvpress puts on attention modules are gone; the attention wrapper a layer budget
    needs (its layers hold different counts, and the model builds one mask, for layer 0) stays
    until the caches the press compressed are collected, since kvpress's pipeline answers from
    such a cache after the ``with`` block.

    Budget: kvpress keeps ``max(1, int(n·(1 − compression_ratio)))`` of *all* n tokens,
    protected ones included, as CurKVCache counts them: the protected tokens come out of that
    budget (only part of the protected span is kept if the budget is smaller than it). On a hybrid
    model only the full-attention layers are compressed; its sliding-window layers keep their window.

    Parameters
    ----------
    scorer : Scorer or str or os.PathLike
        A loaded :class:`Scorer` or the folder of an exported one.
    compression_ratio : float, default=0.0
        Fraction of key-value pairs to remove (kvpress's convention; keep ratio = 1 − it).
    n_sink, window : int, optional
        Protected leading / trailing tokens; default the scorer's own.
    layer_budget : str or LayerBudget, default="scorer"
        ``"scorer"``: a scorer with a calibrated ``layer_budget`` (``curkv-train calibrate``) keeps
        ``int(n·ρ_l)`` in layer l, the ρ_l averaging to 1 − ``compression_ratio`` as in
        :class:`~curkv_train.runtime.CurKVCache` (which reads this argument the same way); the model's
        attention is then switched to the runtime's wrapper, which fits the mask to each layer's length,
        for as long as the press is in use (see above).
        ``"uniform"``: one ratio. A LayerBudget: that split.
    scorer_precision : str, optional
        The scorer's ``matmul_precision`` for this press (``highest`` or ``medium``, as
        :class:`~curkv_train.runtime.CurKVCache` reads it); default the scorer's own.
    """

    scorer: Scorer | str | os.PathLike | None = None
    n_sink: int | None = None
    window: int | None = None
    layer_budget: str | LayerBudget = "scorer"
    scorer_precision: str | None = None
    model: PreTrainedModel | None = field(default=None, init=False, repr=False, compare=False)
    # a hybrid model's sliding-window layers: left as the cache holds them
    sliding: frozenset[int] = field(default=frozenset(), init=False, repr=False, compare=False)
    # caches compressed per layer whose lifetime holds the attention wrapper (weakly: they go when the user drops them)
    budgeted_caches: weakref.WeakSet = field(default_factory=weakref.WeakSet, init=False, repr=False, compare=False)

    def __post_init__(self):
        super().__post_init__()
        if self.scorer is None:
            raise CurKVError("CurKVPress needs a scorer: a Scorer or the folder of an exported one")
        check_layer_budget_choice(self.layer_budget)
        if self.scorer_precision is not None:
            check_matmul_precision(self.scorer_precision)

    def post_init_from_model(self, model: PreTrainedModel) -> None:
        """Load the scorer (checked against ``model``), keep the model for its rotary tables and note its
        sliding-window layers (a hybrid model's: never compressed)."""
        if not isinstance(self.scorer, Scorer):
            self.scorer = load_scorer(self.scorer, model=model)
        self.sliding = frozenset(sliding_layers(model))
        if self.sliding and self.budget is not None:
            raise CurKVError("a layer budget on a hybrid model (sliding-window layers) is not supported yet; "
                             "pass layer_budget='uniform'")
        if self.scorer_precision is not None:
            self.scorer = replace(self.scorer, matmul_precision=self.scorer_precision)
        self.model = model

    @contextmanager
    def __call__(self, model: PreTrainedModel) -> Iterator[None]:
        """kvpress's ``with press(model):`` (its hooks, and :meth:`post_init_from_model`), with the runtime's attention
        wrapper held inside it under a layer budget; on exit, also after an exception, the model is as it was but
        for the wrapper the caches the press compressed hold (:meth:`hold_wrapper_for`)."""
        rotary = snapshot_rotary(model)
        try:
            with super().__call__(model), self.wrapper_hold(model):
                yield
        finally:
            restore_rotary(rotary)

    def wrapper_hold(self, model: PreTrainedModel) -> AbstractContextManager:
        """A hold on the runtime's attention wrapper under a layer budget (a one-line error, before any forward, for
        an attention implementation that cannot fit masks per layer), else nothing."""
        if self.budget is None:
            return nullcontext()
        return install_runtime_attention(model, factored=False, per_layer=True)

    def hold_wrapper_for(self, cache: object) -> None:
        """Keep the model on the runtime's attention wrapper until ``cache`` (compressed per layer) is collected:
        continuing from it, as kvpress's pipeline does after ``with press(model):``, needs the masks fitted per
        layer."""
        if cache is None or cache in self.budgeted_caches:
            return
        install_runtime_attention(self.model, factored=False, per_layer=True).release_with(cache)
        self.budgeted_caches.add(cache)

    @property
    def budget(self) -> LayerBudget | None:
        """The loaded scorer's layer budget when the press follows it, else None."""
        return resolve_layer_budget(self.layer_budget, self.scorer) if isinstance(self.scorer, Scorer) else None

    def score(self, module: nn.Module, hidden_states: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
              attentions: torch.Tensor, kwargs: dict) -> torch.Tensor:
        """Estimator logits (batch, kv_heads, tokens) for ``module.layer_idx``, sinks and window lifted.

        Args:
            hidden_states: (batch, tokens, hidden_size) the prefill's attention inputs, one per cached token.
            keys: (batch, kv_heads, tokens, head_dim) post-RoPE keys of the prefilled context.
            values: (batch, kv_heads, tokens, head_dim) values.
        """
        if self.model is None or not isinstance(self.scorer, Scorer):
            raise CurKVError("CurKVPress is used outside `with press(model):`; call press.post_init_from_model(model)")
        tokens = keys.shape[2]
        if hidden_states.shape[1] != tokens:  # shapes only: nothing read back from the device
            raise CurKVError(f"CurKVPress scores a prefill's tokens at positions 0..n-1 from that prefill's hidden "
                             f"states, but got {hidden_states.shape[1]} hidden states for {tokens} cached tokens "
                             "(kvpress's DecodingPress, or a cache that held tokens before this forward); "
                             "use CurKVCache to compress while decoding")
        positions = torch.arange(tokens, device=keys.device)
        scores = self.scorer.score_layer(self.model, module.layer_idx, keys, values, positions,
                                         **self.scorer.prefill_inputs(self.model, module.layer_idx, hidden_states))
        n_sink = self.scorer.n_sink if self.n_sink is None else self.n_sink
        window = self.scorer.window if self.window is None else self.window
        protected = ~compressible_mask(tokens, n_sink, window, device=keys.device)
        return scores + PROTECTED_SCORE * protected.to(scores.dtype)

    def compress(self, module: nn.Module, hidden_states: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                 attentions: torch.Tensor, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """kvpress's top-k compaction, at layer ``module.layer_idx``'s own ratio under a layer budget; a hybrid
        model's sliding-window layer is returned untouched (it holds its window already).

        Args:
            keys, values: (batch, kv_heads, tokens, head_dim); returned with ``int(tokens·ρ_l)`` tokens
            (at least 1).
        """
        if module.layer_idx in self.sliding:
            return keys, values
        budget = self.budget
        if budget is None or self.compression_ratio == 0:
            return super().compress(module, hidden_states, keys, values, attentions, kwargs)
        self.hold_wrapper_for(kwargs.get("past_key_values"))
        keep = budget.ratios(1.0 - self.compression_ratio)[module.layer_idx]
        scores = self.score(module, hidden_states, keys, values, attentions, kwargs)
        kept = scores.topk(max(1, int(keys.shape[2] * keep)), dim=-1).indices
        kept = kept.unsqueeze(-1).expand(-1, -1, -1, keys.shape[-1])
        return keys.gather(2, kept).contiguous(), values.gather(2, kept).contiguous()


def snapshot_rotary(model: PreTrainedModel) -> dict[nn.Module, object]:
    """Each attention module of ``model`` -> its ``rotary_emb`` submodule, or a marker where it has none (what
    :func:`restore_rotary` gives back after kvpress's ``with press(model):``)."""
    return {module: module._modules.get("rotary_emb", _ABSENT) for module in attention_modules(model)}


def restore_rotary(before: dict[nn.Module, object]) -> None:
    """Give each attention module the ``rotary_emb`` it had in ``before`` (module -> its submodule, or absent):
    kvpress's ``with press(model):`` points every attention module's ``rotary_emb`` at the model's and leaves it."""
    for module, rotary in before.items():
        if rotary is _ABSENT:
            module._modules.pop("rotary_emb", None)
        else:
            module.rotary_emb = rotary
