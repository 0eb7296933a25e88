"""The attention inputs a scorer reads besides K and V: queries of the observation window, hidden states.

Every decoder attention module of a Llama/Mistral/Qwen-style model receives its input hidden
states (after the layer norm) as ``hidden_states``. From them the module's own projections give
the pre-RoPE queries (:func:`pre_rope_queries`), so a scorer that needs "the queries of the last
W tokens" can be fed the last W hidden states — the same thing a kvpress press receives, and
what the runtime cache records as tokens arrive.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel


def query_outer_products(queries: torch.Tensor) -> torch.Tensor:
    """Σ_t q_t q_tᵀ of queries (batch, heads, tokens, head_dim), flattened: (batch, heads, head_dim·head_dim).
    One ``bmm`` over (batch·heads) matrices: a 4-D ``@`` adds expands and reshapes around the same product."""
    batch, heads, tokens, head_dim = queries.shape
    per_head = queries.reshape(batch * heads, tokens, head_dim)
    return torch.bmm(per_head.transpose(1, 2), per_head).view(batch, heads, head_dim * head_dim)


def detached(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` cut from autograd: itself where it needs no gradient (a ``detach`` is an operator, a launch on a
    GPU, and the runtime records a layer's queries under ``no_grad``)."""
    return tensor.detach() if tensor.requires_grad else tensor


@functools.cache
def packing(head_dim: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """How a symmetric (head_dim, head_dim) matrix packs as its upper triangle: the flat square index of
    each triangle entry (head_dim·(head_dim + 1)/2,), and the triangle index of each square entry
    (head_dim²,). Made once per (head_dim, device): the first is used at every decoding step."""
    rows, cols = torch.triu_indices(head_dim, head_dim, device=device)
    square = torch.empty(head_dim, head_dim, dtype=torch.long, device=device)
    entries = torch.arange(rows.shape[0], device=device)
    square[rows, cols] = entries
    square[cols, rows] = entries
    return rows * head_dim + cols, square.flatten()


class QueryStatistics:
    """Running first and second moments of a layer's pre-RoPE queries, over every token seen.

    Bounded memory however long the sequence, float32: (batch, heads, head_dim) sums and the
    outer-product sums, which are symmetric, packed as their upper triangle (batch, heads,
    head_dim·(head_dim + 1)/2): half the bytes of the square, with nothing lost.
    """

    def __init__(self) -> None:
        self.count = 0
        self.total: torch.Tensor | None = None
        self.outer: torch.Tensor | None = None  # packed upper triangle of Σ q qᵀ
        self.square: torch.Tensor | None = None  # :func:`packing`'s unpacking index, shared, set by update

    @classmethod
    def of(cls, queries: torch.Tensor) -> "QueryStatistics":
        """The statistics of ``queries`` (batch, heads, tokens, head_dim)."""
        statistics = cls()
        statistics.update(queries)
        return statistics

    @classmethod
    def stacked(cls, layers: list["QueryStatistics"]) -> "QueryStatistics":
        """The statistics of several layers (each over the same count of queries) side by side, as batch rows: row
        i·batch + b is layer i's row b, so one expected-attention pass serves them all."""
        counts = {statistics.count for statistics in layers}
        if len(counts) != 1:
            raise ValueError(f"stacked statistics must count the same queries, got counts {sorted(counts)}")
        statistics = cls()
        statistics.count, statistics.square = layers[0].count, layers[0].square
        statistics.total = torch.cat([each.total for each in layers])
        statistics.outer = torch.cat([each.outer for each in layers])
        return statistics

    def update(self, queries: torch.Tensor) -> None:
        """Add queries (batch, heads, tokens, head_dim)."""
        queries = detached(queries).float()
        triangle, self.square = packing(queries.shape[-1], queries.device)
        total, outer = queries.sum(dim=2), query_outer_products(queries)[..., triangle]
        self.total = total if self.total is None else self.total + total
        self.outer = outer if self.outer is None else self.outer + outer
        self.count += queries.shape[2]

    def mean(self) -> torch.Tensor:
        """(batch, heads, head_dim) mean query; zeros before any query was counted (a prompt no longer than the
        skipped first tokens), so the expected attention is uniform there rather than NaN."""
        return self.moments()[0]

    def covariance(self) -> torch.Tensor:
        """(batch, heads, head_dim, head_dim) covariance (normalised by the count, as ExpectedAttention)."""
        return self.moments()[1]

    def moments(self, linear: float = 1.0, quadratic: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """``linear`` times the mean (batch, heads, head_dim) and ``quadratic`` times the covariance (batch, heads,
        head_dim, head_dim), ``linear`` > 0: the factors are folded into the three operators that compute them."""
        count = max(self.count, 1)
        mean = self.total * (linear / count)
        head_dim = mean.shape[-1]
        # the index comes from update, not packing(): a compiled scorer traces this, and would trace the cache;
        # a gather with the index expanded, not indexing: 2.4x faster
        second = self.outer.gather(-1, self.square.expand(*self.outer.shape[:-1], -1)).view(-1, head_dim, head_dim)
        flat = mean.reshape(-1, head_dim, 1)  # q·(second / count − mean·meanᵀ) in one operator
        covariance = torch.baddbmm(second, flat, flat.transpose(1, 2), beta=quadratic / count,
                                   alpha=-quadratic / linear**2)
        return mean, covariance.view(*mean.shape, head_dim)

    def nbytes(self) -> int:
        """Bytes held."""
        return sum(t.numel() * t.element_size() for t in (self.total, self.outer) if t is not None)

    @staticmethod
    def nbytes_for(heads: int, head_dim: int) -> int:
        """Bytes the statistics of ``heads`` query heads of ``head_dim`` hold once filled (batch 1)."""
        return heads * (head_dim + head_dim * (head_dim + 1) // 2) * 4

    def map_batch(self, fn) -> None:
        """Apply a batch-dimension operation to the sums."""
        if self.total is not None:
            self.total, self.outer = fn(self.total), fn(self.outer)


@dataclass
class Observation:
    """What a query-aware scorer reads of one layer besides K and V.

    Attributes:
        queries: (batch, heads, W, head_dim) pre-RoPE queries of the last W tokens seen (the
            observation window).
        positions: (W,) their absolute positions.
        statistics: moments of the pre-RoPE queries of every token seen after the first few.
    """

    queries: torch.Tensor
    positions: torch.Tensor
    statistics: QueryStatistics

    def last(self, count: int) -> "Observation":
        """The window cut to its last ``count`` tokens (the statistics are kept)."""
        return Observation(self.queries[:, :, -count:], self.positions[-count:], self.statistics)


def observe_queries(queries: torch.Tensor, skip: int) -> Observation:
    """The observation of a prefill from its pre-RoPE queries (batch, heads, tokens, head_dim) at positions
    0, 1, ...: statistics over the tokens at positions >= ``skip`` (the first tokens' queries are outliers).

    The positions are made on the queries' device and the skipped count on the host, so nothing is read back
    from a GPU (a read-back would stall the host once per layer)."""
    tokens = queries.shape[2]
    positions = torch.arange(tokens, device=queries.device)
    return Observation(queries, positions, QueryStatistics.of(queries[:, :, min(skip, tokens):]))


_DECODERS: "weakref.WeakKeyDictionary[PreTrainedModel, torch.nn.Module]" = weakref.WeakKeyDictionary()


def decoder_of(model: PreTrainedModel) -> torch.nn.Module:
    """``model.get_decoder()``, looked up once per model: scoring asks for it several times a layer (its rotary
    module, its attention modules) at every compression."""
    if torch.compiler.is_compiling():  # traced: the lookup itself is compiled away
        return model.get_decoder()
    decoder = _DECODERS.get(model)
    if decoder is None:
        decoder = _DECODERS[model] = model.get_decoder()
    return decoder


def attention_modules(model: PreTrainedModel) -> list[torch.nn.Module]:
    """The attention module of every decoder layer, in layer order."""
    return [layer.self_attn for layer in decoder_of(model).layers]


def attention_module(model: PreTrainedModel, layer: int) -> torch.nn.Module:
    """The attention module of decoder layer ``layer``."""
    return decoder_of(model).layers[layer].self_attn


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
        with removed_after([module.register_forward_pre_hook(self._record, with_kwargs=True)
                            for module in attention_modules(model)]):
            yield self

    def layers(self) -> list[torch.Tensor]:
        """Recorded hidden states per layer, (batch, tokens, hidden_size) each."""
        return [self.hidden[index] for index in sorted(self.hidden)]


@contextmanager
def removed_after(hooks: list[torch.utils.hooks.RemovableHandle]) -> Iterator[None]:
    """Run the block, then remove ``hooks`` (also when it raises)."""
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()
