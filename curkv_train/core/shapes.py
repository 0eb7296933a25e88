"""What the value estimator and the KV cache see of a base model's architecture (one place for it)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PretrainedConfig

from curkv_train.core.errors import CurKVError


@dataclass(frozen=True)
class KVShape:
    """Attention shapes of a base model.

    Attributes:
        num_layers: decoder layers.
        num_kv_heads: KV heads per layer (GQA groups).
        head_dim: key/value width per head.
        num_attention_heads: query heads per layer.
        max_positions: the model's position limit (None when the config has none).
        hidden_size: width of the residual stream.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_attention_heads: int
    max_positions: int | None
    hidden_size: int

    @property
    def group_size(self) -> int:
        """Query heads per KV head."""
        return self.num_attention_heads // self.num_kv_heads


def text_config(config: PretrainedConfig) -> PretrainedConfig:
    """The decoder's config (the text config of a multimodal model, else ``config`` itself)."""
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def kv_shape(config: PretrainedConfig) -> KVShape:
    """The :class:`KVShape` of ``config`` (head_dim = hidden / heads unless the config sets it)."""
    text = text_config(config)
    heads = text.num_attention_heads
    return KVShape(
        num_layers=text.num_hidden_layers,
        num_kv_heads=getattr(text, "num_key_value_heads", None) or heads,
        head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
        num_attention_heads=heads,
        max_positions=getattr(text, "max_position_embeddings", None),
        hidden_size=text.hidden_size,
    )


def check_unpadded(attention_mask: torch.Tensor | None) -> None:
    """A CurKVError when the model's 4D mask (batch, 1, queries, keys) hides a past key from a row's last query,
    or a 2D padding mask (batch, keys), as a user passes it (and flash attention's mask function keeps it),
    has a 0.

    Without padding the last query of every row sees every key (causal); a padded (left- or
    right-) batch hides its padding, which per-head compression (CurKVCache's compaction, the
    training passes' key biases) cannot follow.
    """
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() not in (2, 4):
        return
    if attention_mask.dim() == 2:
        hidden = attention_mask == 0
    else:
        last = attention_mask[:, :, -1, :]
        hidden = ~last if last.dtype == torch.bool else last < torch.finfo(last.dtype).min / 2
    if bool(hidden.any()):
        raise CurKVError("compressed attention does not support padded batches (the attention mask hides tokens of a row); "
                         "run one sequence per cache, or batch sequences of equal length without padding")
