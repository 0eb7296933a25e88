"""What a score function sees of one layer: cached K/V, the context's queries, lazy attention statistics.

Every method of the evaluation is a score function ``(ctx: LayerContext) -> (batch, kv_heads, tokens)``;
attention-based methods read their statistics from the context, which computes them on
first use, in query chunks, for this layer only (so no more than one layer's attention
statistics exist at a time, and never a full attention matrix of every layer).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from curkv_train.core.observation import attention_module, pre_rope_queries
from curkv_train.core.rope import average_rotation, rotary_tables, rotate

QUERY_CHUNK = 256


@dataclass
class LayerContext:
    """One layer of a prefilled context.

    Attributes:
        layer: decoder layer index.
        keys: (batch, kv_heads, tokens, head_dim) cached keys, post-RoPE as transformers caches them.
        values: (batch, kv_heads, tokens, head_dim) cached values.
        positions: (tokens,) absolute positions of the cached tokens.
        hidden: (batch, tokens, hidden_size) the layer's attention inputs (queries are derived from
            them with the layer's own projection), or None.
        queries: (batch, heads, tokens, head_dim) pre-RoPE queries given directly (tests); overrides hidden.
        probs: (batch, heads, tokens, tokens) a given attention matrix (tests); overrides queries.
        scaling: the attention logit scale; default the layer's own (head_dim ** -0.5 without a model).
        model: the base model (attention projections, rotary tables, the trained scorer); may be None
            when neither hidden states nor RoPE are involved.
        n_sink, window: the always-kept spans of the selection.
        seed: seed for stochastic methods, distinct per example and layer.
    """

    layer: int
    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    hidden: torch.Tensor | None = None
    queries: torch.Tensor | None = None
    probs: torch.Tensor | None = None
    scaling: float | None = None
    model: PreTrainedModel | None = None
    n_sink: int = 4
    window: int = 64
    seed: int = 0
    _memo: dict = field(default_factory=dict, repr=False)

    @property
    def num_tokens(self) -> int:
        """Cached context tokens."""
        return self.keys.shape[2]

    @property
    def group_size(self) -> int:
        """Query heads per KV head."""
        heads = (self.probs if self.probs is not None else self.pre_rope_queries()).shape[1]
        return heads // self.keys.shape[1]

    @property
    def scale(self) -> float:
        """The attention logit scale of this layer."""
        if self.scaling is not None:
            return self.scaling
        module = attention_module(self.model, self.layer) if self.model is not None else None
        return getattr(module, "scaling", self.keys.shape[-1] ** -0.5)

    def group_mean(self, per_head: torch.Tensor) -> torch.Tensor:
        """(batch, heads, ...) per query head -> (batch, kv_heads, ...) averaged over each KV head's group."""
        batch, heads = per_head.shape[:2]
        grouped = per_head.reshape(batch, heads // self.group_size, self.group_size, *per_head.shape[2:])
        return grouped.mean(dim=2)

    def pre_rope_queries(self) -> torch.Tensor:
        """(batch, heads, tokens, head_dim) float32 context queries before RoPE."""
        if "queries" not in self._memo:
            if self.queries is not None:
                self._memo["queries"] = self.queries.float()
            elif self.hidden is not None and self.model is not None:
                self._memo["queries"] = pre_rope_queries(attention_module(self.model, self.layer), self.hidden).float()
            else:
                raise ValueError("this method needs the context's queries; prefill with capture_queries=True")
        return self._memo["queries"]

    def rotated_queries(self) -> torch.Tensor:
        """(batch, heads, tokens, head_dim) float32 context queries after RoPE, as attention saw them."""
        if "rotated" not in self._memo:
            queries = self.pre_rope_queries()
            tables = rotary_tables(self.model, self.positions, queries) if self.model is not None else None
            self._memo["rotated"] = rotate(queries, *tables) if tables is not None else queries
        return self._memo["rotated"]

    def attention(self, start: int, stop: int) -> torch.Tensor:
        """Causal attention probabilities of context queries [start, stop): (batch, heads, stop - start, tokens)."""
        if self.probs is not None:
            return self.probs[:, :, start:stop].float()
        queries = self.rotated_queries()[:, :, start:stop]
        batch, heads, count, dim = queries.shape
        kv_heads = self.keys.shape[1]
        scale = self.scale
        grouped = queries.reshape(batch, kv_heads, heads // kv_heads, count, dim)
        logits = torch.einsum("bhgmd,bhnd->bhgmn", grouped, self.keys.float()) * scale
        query_positions = torch.arange(start, stop, device=logits.device)
        future = torch.arange(self.num_tokens, device=logits.device)[None, :] > query_positions[:, None]
        logits = logits.masked_fill(future, float("-inf"))
        return logits.softmax(dim=-1).reshape(batch, heads, count, self.num_tokens)

    def attention_mass(self) -> torch.Tensor:
        """(batch, heads, tokens) attention each key received, summed over every context query."""
        if "mass" not in self._memo:
            total = None
            for start in range(0, self.num_tokens, QUERY_CHUNK):
                part = self.attention(start, min(start + QUERY_CHUNK, self.num_tokens)).sum(dim=2)
                total = part if total is None else total + part
            self._memo["mass"] = total
        return self._memo["mass"]

    def window_attention(self, size: int) -> torch.Tensor:
        """(batch, heads, size, tokens) attention of the last ``size`` context queries."""
        size = min(size, self.num_tokens)
        return self.attention(self.num_tokens - size, self.num_tokens)

    def average_rotation(self, start: int, count: int) -> torch.Tensor:
        """(head_dim, head_dim) RoPE rotation averaged over positions [start, start + count) (identity without RoPE)."""
        return average_rotation(self.model, start, count, self.keys.shape[-1], self.keys)
