"""Factored cold attention at run time: attend to CurKVCache's cold blocks through their CUR factors.

Constructing a :class:`~curkv_train.runtime.cache.CurKVCache` for a model calls
:func:`install_runtime_attention`, which (idempotently)

- puts :func:`record_cache_layer` as a forward pre-hook on every decoder attention
  module: before each call, when ``past_key_values`` is a CurKVCache, it records on the
  module the cache layer the call will use (``None`` for any other cache), hands that layer
  the module's input hidden states (scorers that score a token on arrival read them) and
  tells it whether this call's attention is factored; and :func:`record_queries` and
  :func:`record_keys` as forward hooks on the module's query and key projections, which hand
  the recorded layer the pre-RoPE queries (query-aware scorers read them) and keys (a
  prefill's first compression reads its pre_rope key view from them) it projected;
- when asked to (a cache with a cold tier), switches the model's attention implementation
  (``sdpa`` or ``eager``) to a wrapper registered under ``curkv_factored_<implementation>``,
  with the wrapped implementation's mask function (so masks are unchanged).

A step then runs as follows. ``CurKVLayer.update`` returns only the dense tokens
(sinks, warm, hot, new) and leaves the cold blocks it did not reconstruct in
``layer.factored_cold``; ``get_mask_sizes`` still counts the cold tokens first. The
wrapper finds the layer recorded on its ``module``: with cold blocks pending it runs
:func:`curkv_train.kernels.factored_attention` (one softmax over [cold | dense], no
dense copy of a cold block); otherwise it calls the wrapped implementation unchanged,
so a cache without cold blocks attends exactly as before. Any other attention
implementation is left alone and the cache reconstructs its cold blocks as before.

This module imports no training code (no Lightning, no ``curkv_train.training.scored_attention``).
"""

from __future__ import annotations

import logging
import sys
import weakref
from typing import Any, Callable

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from curkv_train.core.shapes import check_unpadded
from curkv_train.core.observation import attention_modules
from curkv_train.core.errors import CurKVError
from curkv_train.kernels import factored_attention
from curkv_train.runtime.cache import CurKVCache
from curkv_train.runtime.layer import CurKVLayer

log = logging.getLogger(__name__)

FACTORED_PREFIX = "curkv_factored_"
WRAPPABLE = ("sdpa", "eager")
LAYER_ATTRIBUTE = "curkv_cache_layer"
HOOK_ATTRIBUTE = "curkv_pre_hook"
ATTENTION_ATTRIBUTE = "curkv_attention_module"

AttentionFn = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]


def is_factored(implementation: str | None) -> bool:
    """Whether ``implementation`` (a config's ``_attn_implementation``) is one of the factored wrappers."""
    return bool(implementation) and implementation.startswith(FACTORED_PREFIX)


def cache_layer_of(module: torch.nn.Module) -> CurKVLayer | None:
    """The CurKVCache layer the current call of attention ``module`` uses, or None."""
    reference = getattr(module, LAYER_ATTRIBUTE, None)
    return None if reference is None else reference()


def record_cache_layer(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Forward pre-hook (``with_kwargs=True``) of a decoder attention module.

    When ``kwargs["past_key_values"]`` is a CurKVCache, hands it the module's input hidden
    states, records its layer for this module (a weak reference: the module never keeps a
    cache alive) and tells the layer whether this call's attention is factored (the cache
    allows it and the model's implementation is a factored wrapper); otherwise clears the record.
    """
    cache = kwargs.get("past_key_values")
    if not isinstance(cache, CurKVCache):
        setattr(module, LAYER_ATTRIBUTE, None)
        return
    layer = cache.layers[module.layer_idx]
    hidden_states = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
    if cache.sliding_window:  # the first layer checks every layer's count: a refused step is refused before any
        # layer appended (under a layer budget layer 0 may hold fewer than the one that refuses)
        counts = [each.held_tokens for each in cache.layers] if module.layer_idx == 0 else [layer.held_tokens]
        check_within_window(cache.sliding_window, max(counts), hidden_states.shape[1])
    layer.observe_hidden(hidden_states)
    implementation = getattr(module.config, "_attn_implementation", None)
    layer.factored_attention = cache.factored_attention and is_factored(implementation)
    setattr(module, LAYER_ATTRIBUTE, weakref.ref(layer))


def refuse_padding(decoder: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Forward pre-hook (``with_kwargs=True``) of the base model: a padded batch's 2D attention mask, refused
    with one line when ``past_key_values`` is a CurKVCache, whatever the attention implementation (flash
    attention keeps the 2D mask and flex attention a block mask): checked once per forward, before any layer,
    rather than in every attention module's pre-hook."""
    if isinstance(kwargs.get("past_key_values"), CurKVCache):
        check_unpadded(kwargs.get("attention_mask"))


def record_queries(projection: torch.nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> None:
    """Forward hook of an attention module's query projection (``q_norm`` if it has one, else ``q_proj``):
    hands the layer recorded by :func:`record_cache_layer` the queries it just projected, pre-RoPE,
    as (batch, heads, new, head_dim) — the statistics then cost no extra projection."""
    layer, heads = projected_heads(projection, output)
    if layer is not None:
        layer.observe_queries(heads)


def record_keys(projection: torch.nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> None:
    """Forward hook of an attention module's key projection (``k_norm`` if it has one, else ``k_proj``): hands the
    recorded layer the keys it just projected, pre-RoPE, as (batch, kv_heads, new, head_dim) — a view, kept only
    until the layer's update: a prefill's first compression reads its pre_rope key view from them instead of
    turning every cached key back."""
    layer, heads = projected_heads(projection, output)
    if layer is not None:
        layer.observe_keys(heads)


def projected_heads(projection: torch.nn.Module, output: torch.Tensor) -> tuple[CurKVLayer | None, torch.Tensor | None]:
    """The cache layer recorded for ``projection``'s attention module (:func:`record_cache_layer`), and the
    projection's output (batch, new, heads · head_dim) as (batch, heads, new, head_dim); (None, None) without one."""
    attention = getattr(projection, ATTENTION_ATTRIBUTE)()
    layer = None if attention is None else cache_layer_of(attention)
    if layer is None:
        return None, None
    batch, tokens = output.shape[0], output.shape[1]
    return layer, output.reshape(batch, tokens, -1, attention.head_dim).transpose(1, 2)


def check_within_window(window: int | None, held: int, new: int) -> None:
    """A CurKVError when a model's sliding-window mask would hide held tokens: ``held`` + ``new`` > ``window``.

    The mask places the held tokens just before the new ones, so past the window it hides the oldest held
    ones, whatever the compression kept; the cache cannot follow that (it would also read as padding).
    """
    if window and held + new > window:
        raise CurKVError(f"the model's sliding window ({window} tokens) is exceeded: {held} held + {new} new tokens; "
                         "CurKVCache does not slide a window over compressed tokens: stay within it, or use a model "
                         "without a sliding window")


def _eager_function(module: torch.nn.Module) -> AttentionFn:
    """The ``eager_attention_forward`` of the modeling file that defines ``module``'s class."""
    function = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if function is None:
        raise CurKVError(f"{type(module).__name__} has no eager_attention_forward in its modeling file; "
                         "use attn_implementation='sdpa'")
    return function


def wrapped_function(module: torch.nn.Module, implementation: str) -> AttentionFn:
    """The attention function ``implementation`` (sdpa or eager) as ``module``'s model would call it."""
    return _eager_function(module) if implementation == "eager" else ALL_ATTENTION_FUNCTIONS[implementation]


def fit_mask(attention_mask: torch.Tensor | None, width: int) -> torch.Tensor | None:
    """The model's mask (batch, 1, queries, keys), built for layer 0's held tokens, fitted to a layer holding
    ``width`` keys (a layer budget gives layers different counts).

    Held tokens all precede the new ones and, unpadded, every query sees all of them, so only the
    leading all-visible columns differ: they are cut or repeated on the left.
    """
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape[-1] == width:
        return attention_mask
    extra = width - attention_mask.shape[-1]
    if extra < 0:
        return attention_mask[..., -extra:]
    visible = attention_mask[..., :1].expand(*attention_mask.shape[:-1], extra)
    return torch.cat([visible, attention_mask], dim=-1)


def factored_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                               value: torch.Tensor, attention_mask: torch.Tensor | None,
                               layer: CurKVLayer, dropout: float = 0.0, scaling: float | None = None,
                               **kwargs: Any) -> tuple[torch.Tensor, None]:
    """One softmax over ``layer.factored_cold`` (through their factors) and the dense ``key``/``value``.

    Args:
        query: (batch, q_heads, M, head_dim) post-RoPE queries.
        key, value: (batch, kv_heads, N, head_dim) the dense tokens update returned (the
            last M of them the queries' own).
        attention_mask: the model's mask, None or (batch, 1, M, cold + N) with the cold
            columns first: only its width is checked; attention is causal over the dense
            part and sees every cold token (batch 1 or unpadded batches, as the cache).
        layer: the cache layer recorded for ``module``.

    Returns:
        ((batch, M, q_heads, head_dim) attention output, None).
    """
    if dropout:
        raise CurKVError("factored cold attention is for inference; put the model in eval mode (dropout > 0)")
    cold = layer.factored_cold
    cold_tokens = sum(block.tokens for block in cold)
    if layer.settings.layer_budget is not None:
        attention_mask = fit_mask(attention_mask, cold_tokens + key.shape[-2])  # held_tokens has the new ones
    if isinstance(attention_mask, torch.Tensor) and attention_mask.shape[-1] != cold_tokens + key.shape[-2]:
        raise CurKVError(f"layer {layer.layer_idx}: the attention mask spans {attention_mask.shape[-1]} keys, "
                         f"expected {cold_tokens} cold + {key.shape[-2]} dense; was the cache modified mid-step?")
    out = factored_attention(query, [block.keys for block in cold], [block.values for block in cold], key, value,
                             scale=scaling, causal=True, backend=layer.settings.backend)
    return out.transpose(1, 2).contiguous(), None


def make_factored_attention(implementation: str) -> AttentionFn:
    """The attention function registered as ``curkv_factored_<implementation>``."""

    def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
        layer = cache_layer_of(module)
        if layer is None or not layer.factored_cold:
            # Layers of a budgeted cache (a CurKVCache or a plain cache compressed per layer) differ in length.
            attention_mask = fit_mask(attention_mask, key.shape[-2])
            return wrapped_function(module, implementation)(module, query, key, value, attention_mask,
                                                            *args, **kwargs)
        return factored_attention_forward(module, query, key, value, attention_mask, layer, *args, **kwargs)

    attention.__name__ = attention.__qualname__ = f"{FACTORED_PREFIX}{implementation}_attention"
    return attention


def register_factored_attention(implementation: str) -> str:
    """Register the factored wrapper of ``implementation`` and its mask function (idempotent); returns its name."""
    name = FACTORED_PREFIX + implementation
    if name not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(name, make_factored_attention(implementation))
    if name not in ALL_MASK_ATTENTION_FUNCTIONS:
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[implementation])
    return name


def install_runtime_attention(model: PreTrainedModel, factored: bool = True, per_layer: bool = False) -> bool:
    """Hook every decoder attention module of ``model`` and, with ``factored`` or ``per_layer``, switch it to
    the wrapper (both idempotent): it attends to cold blocks through their factors and fits the
    model's mask to each layer's held tokens (layers of a cache with a layer budget hold different
    counts; the model builds one mask, for layer 0).

    Returns:
        Whether the model now runs factored cold attention (asked for, and its implementation
        was sdpa or eager, or already factored). With any other implementation the hooks are
        still installed and the cache reconstructs its cold blocks.
    """
    implementation = model.config._attn_implementation
    if per_layer and "flex" in (implementation or ""):
        raise CurKVError(f"attention implementation {implementation!r} builds one block mask for layer 0's length, "
                         "and a layer budget holds a different number of tokens in each layer: load the model with "
                         "attn_implementation='sdpa' or 'eager', or pass layer_budget='uniform'")
    decoder = model.get_decoder()
    if getattr(decoder, HOOK_ATTRIBUTE, None) is None:
        setattr(decoder, HOOK_ATTRIBUTE, decoder.register_forward_pre_hook(refuse_padding, with_kwargs=True))
    for module in attention_modules(model):
        if getattr(module, HOOK_ATTRIBUTE, None) is None:
            setattr(module, HOOK_ATTRIBUTE, module.register_forward_pre_hook(record_cache_layer, with_kwargs=True))
            for norm, linear, hook in (("q_norm", "q_proj", record_queries), ("k_norm", "k_proj", record_keys)):
                projection = getattr(module, norm, None) or getattr(module, linear)  # Qwen3 / Gemma3 normalise them
                setattr(projection, ATTENTION_ATTRIBUTE, weakref.ref(module))
                projection.register_forward_hook(hook)
    if not (factored or per_layer):
        return False
    if is_factored(implementation):
        return factored
    if implementation not in WRAPPABLE:
        if per_layer:
            log.info("attention implementation %r: a layer budget needs masks fitted per layer, done for %s only; "
                     "implementations without a 4D mask need none", implementation, " or ".join(WRAPPABLE))
        if factored:
            log.info("attention implementation %r: CurKVCache reconstructs its cold blocks at each step "
                     "(factored cold attention wraps %s)", implementation, " or ".join(WRAPPABLE))
        return False
    if implementation == "eager":
        _eager_function(attention_modules(model)[0])
    model.set_attn_implementation(register_factored_attention(implementation))
    return factored
