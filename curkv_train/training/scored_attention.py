"""The ``curkv`` attention function, registered with transformers' AttentionInterface.

Every decoder layer of a patched model calls :func:`curkv_attention_forward`. What
it does is decided per forward call by a :class:`CompressionState` passed as the
model keyword ``curkv_state`` (transformers forwards extra keywords down to the
attention function):

- no state, or ``mode="full"``: plain causal attention (SDPA);
- ``mode="reconstruct"``: plain attention that also records, per layer, the KVzip+
  score of each context key (:mod:`curkv_train.training.reconstruction`; the dense target);
- ``mode="scored"``: the continuation's queries see context key j through
  ``logit + key_bias[layer][j]`` (the student, DESIGN §4), via the fused path.

Only full-attention layers are compressed (:func:`full_attention_layers`). A sliding-window layer
(Gemma 3's ``sliding_attention``) already holds a bounded window: in every mode it attends as the
plain model does, through its own sliding mask, and records no reconstruction scores.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, PretrainedConfig
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from curkv_train.core.errors import CurKVError
from curkv_train.core.shapes import check_unpadded, text_config
from curkv_train.kernels import scored_attention
from curkv_train.kernels.reference import causal_key_mask
from curkv_train.runtime.hybrid import sliding_layers
from curkv_train.training.reconstruction import reconstruction_scores

ATTENTION_NAME = "curkv"
MODES = ("full", "reconstruct", "scored")
FULL_ATTENTION = "full_attention"  # the ``config.layer_types`` entry of a layer whose cache grows with the context


@dataclass
class CompressionState:
    """What the ``curkv`` attention does during one forward call.

    Attributes:
        mode: one of ``full``, ``reconstruct``, ``scored``.
        context_length: number of leading cached tokens the bias and scores refer to.
        key_bias: per layer, (batch, kv_heads, context_length) float32 added to the
            continuation's logits on context keys (``scored`` mode); None (or anything) for a
            layer that is not full attention, which is never read.
        backend: kernel backend for ``scored`` mode (auto, torch, triton).
        reconstruction: filled in ``reconstruct`` mode: per full-attention layer, (batch, kv_heads,
            context_length) KVzip+ score of each context key.
    """

    mode: str = "full"
    context_length: int = 0
    key_bias: list[torch.Tensor | None] | None = None
    backend: str = "auto"
    reconstruction: dict[int, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown attention mode {self.mode!r}; expected one of {', '.join(MODES)}")


def curkv_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    curkv_state: CompressionState | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention for one layer; query (B, Hq, M, d), key/value (B, Hkv, N, d) -> (B, M, Hq, d).

    ``scaling`` is the module's own logit scale (Gemma 3's ``query_pre_attn_scalar``^-0.5, not always d^-0.5).
    """
    state = curkv_state
    mode = "full" if state is None or not is_full_attention(module) else state.mode
    if mode == "full" and (attention_mask is not None or query.shape[2] == key.shape[2]):
        # A square causal block or an explicit mask (a sliding window's, a padded batch's): SDPA reads both.
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    check_unpadded(attention_mask)  # unpadded, the mask is causal only: applied below (bottom-right)
    layer = module.layer_idx
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    if mode != "scored":
        # No bias: plain attention, bottom-right causal (transformers passes mask=None for queries over
        # a cache and relies on is_causal, which SDPA aligns top-left).
        visible = causal_key_mask(query.shape[2], key.shape[2], query.device)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=visible, scale=scale, enable_gqa=True)
        if mode == "reconstruct":
            state.reconstruction[layer] = reconstruction_scores(module, query, key, value,
                                                                min(state.context_length, key.shape[2]), scale)
        return out.transpose(1, 2).contiguous(), None
    context_bias = state.key_bias[layer].to(key.device)
    zeros = torch.zeros(*key.shape[:2], key.shape[2] - context_bias.shape[-1], device=key.device)
    bias = torch.cat([context_bias, zeros], dim=-1)
    out = scored_attention(query, key, value, bias, scale=scale, causal=True, backend=state.backend)
    return out.transpose(1, 2).contiguous(), None


def full_attention_layers(config: PretrainedConfig) -> list[int]:
    """Indices of the layers the estimator compresses: those whose ``config.layer_types`` entry is
    ``full_attention`` (every layer of a model whose config has no layer types). Sliding-window layers hold
    a bounded window and are never compressed; their estimator rows go unused."""
    text = text_config(config)
    types = getattr(text, "layer_types", None) or [FULL_ATTENTION] * text.num_hidden_layers
    return [layer for layer, kind in enumerate(types) if kind == FULL_ATTENTION]


def is_full_attention(module: torch.nn.Module) -> bool:
    """Whether attention ``module`` (its ``config`` and ``layer_idx``) is a full-attention layer."""
    return module.layer_idx in full_attention_layers(module.config)


def register_attention() -> str:
    """Register :func:`curkv_attention_forward` under ``curkv`` (idempotent) and return the name.

    Its mask function is SDPA's, so a padded batch's mask reaches it (without one, transformers
    passes no mask at all and padding would be attended silently).
    """
    AttentionInterface.register(ATTENTION_NAME, curkv_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    return ATTENTION_NAME


def patch_model(model: torch.nn.Module) -> torch.nn.Module:
    """Route every decoder layer of ``model`` through the ``curkv`` attention function.

    A model whose attention soft-caps its logits (Gemma 2) is refused: the fused path does not cap them; so is
    one with layer types other than full and sliding-window attention, or none of the full kind, as the runtime
    refuses them (:func:`~curkv_train.runtime.hybrid.sliding_layers`).
    """
    sliding_layers(model)
    softcap = getattr(text_config(model.config), "attn_logit_softcapping", None)
    if softcap is not None:
        raise CurKVError(f"{type(model).__name__} soft-caps its attention logits at {softcap}, which the curkv "
                         "attention does not apply; train on a model without attn_logit_softcapping")
    register_attention()
    try:
        model.set_attn_implementation(ATTENTION_NAME)
    except (ValueError, AttributeError) as error:
        raise CurKVError(f"cannot patch the attention of {type(model).__name__}: {error}") from error
    return model
