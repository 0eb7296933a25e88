"""The runtime's hooks on a model, and factored cold attention over CurKVCache's cold blocks.

A model is touched only while something holds it (DESIGN §7): :func:`install_runtime_attention`
returns a :class:`RuntimeAttention` hold, which an open :class:`~curkv_train.runtime.cache.CurKVCache`
keeps until it is closed or collected, and :class:`~curkv_train.runtime.press.CurKVPress` inside
``with press(model):``. Holds are counted per model: the first one

- puts :func:`record_cache_layer` as a forward pre-hook on every decoder attention module:
  before each call, when ``past_key_values`` is a cache registered with a hold, it records the
  cache layer the call will use (``None`` for any other cache), hands that layer the module's
  input hidden states (scorers that score a token on arrival read them) and tells it whether
  this call's attention is factored; :func:`record_queries` and :func:`record_keys` as forward
  hooks on the module's query and key projections, which hand the recorded layer the pre-RoPE
  queries (query-aware scorers read them) and keys (a prefill's first compression reads its
  pre_rope key view from them) it projected; and :func:`refuse_padding` on the decoder;

and a hold that asks for it (a cache with a cold tier, or a layer budget) switches the model's
attention implementation (``sdpa`` or ``eager``) to a wrapper registered under
``curkv_factored_<implementation>``, with the wrapped implementation's mask function (so masks
are unchanged). The last hold asking for the wrapper restores the implementation it replaced;
the last hold of all removes every hook. Nothing else is stored on the model: the layer a call
uses is kept here, keyed by its attention module.

A step then runs as follows. ``CurKVLayer.update`` returns only the dense tokens
(sinks, warm, hot, new) and leaves the cold blocks it did not reconstruct in
``layer.factored_cold``; ``get_mask_sizes`` still counts the cold tokens first. The
wrapper finds the layer recorded for its ``module``: with cold blocks pending it runs
:func:`curkv_train.kernels.factored_attention` (one softmax over [cold | dense], no
dense copy of a cold block); otherwise it calls the wrapped implementation unchanged,
so a cache without cold blocks attends exactly as before. A layer whose KV heads hold different counts (joint
allocation) leaves its ragged storage in ``layer.ragged_step`` instead, and the wrapper attends over it with
:func:`curkv_train.kernels.ragged_attention`; such a cache refuses any implementation but sdpa or eager. Any other
attention implementation is left alone and the cache reconstructs its cold blocks as before.

This module imports no training code and no cache: the hooks read a cache through
:class:`ServedCache`.
"""

from __future__ import annotations

import functools
import logging
import sys
import weakref
from typing import Any, Callable, Protocol

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from curkv_train.core.errors import CurKVError
from curkv_train.core.observation import attention_modules
from curkv_train.core.shapes import check_unpadded
from curkv_train.kernels import RaggedKV, factored_attention, ragged_attention
from curkv_train.runtime.layer import CurKVLayer

log = logging.getLogger(__name__)

FACTORED_PREFIX = "curkv_factored_"
WRAPPABLE = ("sdpa", "eager")

AttentionFn = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]


class ServedCache(Protocol):
    """What the hooks read from a cache they serve (a :class:`~curkv_train.runtime.cache.CurKVCache`)."""

    layers: list  # CurKVLayers, and a hybrid model's sliding-window layers (transformers' own)
    sliding_window: int | None  # the model's window over every compressed layer, or None
    factored_attention: bool  # whether the cache may attend to its cold blocks through their factors


# attention module -> (a weak reference to) the cache layer its current call uses; read by the factored wrapper
_current_layers: weakref.WeakKeyDictionary[nn.Module, weakref.ref] = weakref.WeakKeyDictionary()
# attention module -> the new tokens of its current call (how the projections' outputs are laid out)
_current_tokens: weakref.WeakKeyDictionary[nn.Module, int] = weakref.WeakKeyDictionary()


def is_factored(implementation: str | None) -> bool:
    """Whether ``implementation`` (a config's ``_attn_implementation``) is one of the factored wrappers."""
    return bool(implementation) and implementation.startswith(FACTORED_PREFIX)


def cache_layer_of(module: nn.Module) -> CurKVLayer | None:
    """The CurKVCache layer the current call of attention ``module`` uses, or None."""
    reference = _current_layers.get(module)
    return None if reference is None else reference()


def record_cache_layer(served: weakref.WeakSet, module: nn.Module, args: tuple[Any, ...],
                       kwargs: dict[str, Any]) -> None:
    """Forward pre-hook (``with_kwargs=True``, ``served`` bound) of a decoder attention module.

    When ``kwargs["past_key_values"]`` is one of the ``served`` caches, hands it the module's input
    hidden states, records its layer for this module (a weak reference: nothing here keeps a
    cache alive) and tells the layer whether this call's attention is factored (the cache
    allows it and the model's implementation is a factored wrapper); otherwise clears the record.
    """
    cache: ServedCache | None = kwargs.get("past_key_values")
    if cache is None or cache not in served:
        _current_layers.pop(module, None)
        return
    layer = cache.layers[module.layer_idx]
    if not isinstance(layer, CurKVLayer):  # a hybrid model's sliding-window layer: nothing to record or wrap
        _current_layers.pop(module, None)
        return
    hidden_states = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
    if cache.sliding_window:  # the first layer checks every layer's count: a refused step is refused before any
        # layer appended (under a layer budget layer 0 may hold fewer than the one that refuses)
        counts = [each.held_tokens for each in cache.layers if isinstance(each, CurKVLayer)] if module.layer_idx == 0 else [layer.held_tokens]
        check_within_window(cache.sliding_window, max(counts), hidden_states.shape[1])
    layer.observe_hidden(hidden_states)
    implementation = getattr(module.config, "_attn_implementation", None)
    layer.factored_attention = cache.factored_attention and is_factored(implementation)
    _current_layers[module] = weakref.ref(layer)
    _current_tokens[module] = hidden_states.shape[1]


def refuse_padding(served: weakref.WeakSet, decoder: nn.Module, args: tuple[Any, ...],
                   kwargs: dict[str, Any]) -> None:
    """Forward pre-hook (``with_kwargs=True``, ``served`` bound) of the base model: a padded batch's 2D attention
    mask, refused with one line when ``past_key_values`` is one of the ``served`` caches, whatever the attention
    implementation (flash attention keeps the 2D mask and flex attention a block mask): checked once per forward,
    before any layer, rather than in every attention module's pre-hook."""
    cache = kwargs.get("past_key_values")
    if cache is not None and cache in served:
        check_unpadded(kwargs.get("attention_mask"))


def record_queries(attention: weakref.ref, projection: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> None:
    """Forward hook (``attention`` bound: its attention module) of a query projection (``q_norm`` if the module has
    one, else ``q_proj``): hands the layer recorded by :func:`record_cache_layer` the queries it just projected,
    pre-RoPE, as (batch, heads, new, head_dim) — the statistics then cost no extra projection."""
    layer, heads = projected_heads(attention(), output)
    if layer is not None:
        layer.observe_queries(heads)


def record_keys(attention: weakref.ref, projection: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> None:
    """Forward hook (``attention`` bound: its attention module) of a key projection (``k_norm`` if the module has one,
    else ``k_proj``): hands the recorded layer the keys it just projected, pre-RoPE, as (batch, kv_heads, new,
    head_dim) — a view, kept only until the layer's update: a prefill's first compression reads its pre_rope key
    view from them instead of turning every cached key back."""
    layer, heads = projected_heads(attention(), output)
    if layer is not None:
        layer.observe_keys(heads)


def projected_heads(attention: nn.Module | None,
                    output: torch.Tensor) -> tuple[CurKVLayer | None, torch.Tensor | None]:
    """The cache layer recorded for ``attention`` (:func:`record_cache_layer`), and its projection's output as
    (batch, heads, new, head_dim); (None, None) without one.

    The output is a linear's (batch, new, heads · head_dim), a norm's before the heads are moved (Qwen 3:
    (batch, new, heads, head_dim)) or after (Gemma 3: (batch, heads, new, head_dim)); the new-token count of the call
    and, where heads and tokens are as many, the strides tell the two norms apart."""
    layer = None if attention is None else cache_layer_of(attention)
    if layer is None:
        return None, None
    if output.dim() == 4 and heads_first(output, _current_tokens.get(attention, -1)):
        return layer, output
    batch, tokens = output.shape[0], output.shape[1]
    return layer, output.reshape(batch, tokens, -1, attention.head_dim).transpose(1, 2)


def heads_first(output: torch.Tensor, tokens: int) -> bool:
    """Whether a norm's 4D ``output`` is (batch, heads, tokens, head_dim) rather than (batch, tokens, heads,
    head_dim), for a call of ``tokens`` new tokens."""
    if output.shape[1] != output.shape[2]:
        return output.shape[2] == tokens
    return output.stride(1) < output.stride(2)  # heads moved after the projection: a transposed view's strides


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


def ragged_attention_forward(module: torch.nn.Module, query: torch.Tensor, store: RaggedKV, backend: str,
                             dropout: float = 0.0, scaling: float | None = None,
                             **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Attention of ``query`` over a ragged layer's storage (each KV head its own tokens, the queries' own last).

    Args:
        query: (batch, q_heads, M, head_dim) post-RoPE queries of the M newest tokens of every segment.
        store: the layer's storage for this step (:attr:`~curkv_train.runtime.layer.CurKVLayer.ragged_step`).

    Returns:
        ((batch, M, q_heads, head_dim) attention output, None); the model's mask is not read (batch 1 or
        unpadded batches, causal bottom-right per segment).
    """
    if dropout:
        raise CurKVError("ragged attention is for inference; put the model in eval mode (dropout > 0)")
    out = ragged_attention(query, store.keys, store.values, store.offsets, store.lengths, scale=scaling,
                           check_bounds=False, backend=backend)
    return out.transpose(1, 2).contiguous(), None


def make_factored_attention(implementation: str) -> AttentionFn:
    """The attention function registered as ``curkv_factored_<implementation>``."""

    def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
        layer = cache_layer_of(module)
        if layer is not None and layer.ragged_step is not None:
            store, layer.ragged_step = layer.ragged_step, None
            return ragged_attention_forward(module, query, store, layer.settings.backend, *args, **kwargs)
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


class ModelHooks:
    """The runtime's hooks on one model, shared by every hold on it (:func:`install_runtime_attention`).

    Attributes:
        served: the caches the hooks serve (weakly held: a collected cache leaves by itself).
        holds: live holds on the model; the last one released removes ``handles``.
        wrapper_holds: live holds that asked for the factored wrapper; the last one released
            restores ``replaced``.
        replaced: the attention implementation the wrapper replaced, or None while it is not installed.
    """

    def __init__(self, model: PreTrainedModel) -> None:
        self.served: weakref.WeakSet = weakref.WeakSet()
        self.holds = self.wrapper_holds = 0
        self.replaced: str | None = None
        self.attention = [weakref.ref(module) for module in attention_modules(model)]
        decoder = model.get_decoder()
        self.handles: list[RemovableHandle] = [
            decoder.register_forward_pre_hook(functools.partial(refuse_padding, self.served), with_kwargs=True)]
        for module in attention_modules(model):
            self.handles.append(module.register_forward_pre_hook(functools.partial(record_cache_layer, self.served),
                                                                 with_kwargs=True))
            for norm, linear, hook in (("q_norm", "q_proj", record_queries), ("k_norm", "k_proj", record_keys)):
                projection = getattr(module, norm, None) or getattr(module, linear)  # Qwen3 / Gemma3 normalise them
                self.handles.append(projection.register_forward_hook(functools.partial(hook, weakref.ref(module))))

    def hold_wrapper(self, model: PreTrainedModel, factored: bool, per_layer: bool) -> bool:
        """Switch ``model`` to the factored wrapper of its implementation, or count one more hold on the wrapper
        already switched to; returns whether this hold counts (False: another implementation, left alone)."""
        implementation = model.config._attn_implementation
        if is_factored(implementation):
            if self.replaced is None:  # switched by someone else: not ours to restore
                return False
            self.wrapper_holds += 1
            return True
        if implementation not in WRAPPABLE:
            if per_layer:
                log.info("attention implementation %r: a layer budget needs masks fitted per layer, done for %s only; "
                         "implementations without a 4D mask need none", implementation, " or ".join(WRAPPABLE))
            if factored:
                log.info("attention implementation %r: CurKVCache reconstructs its cold blocks at each step "
                         "(factored cold attention wraps %s)", implementation, " or ".join(WRAPPABLE))
            return False
        model.set_attn_implementation(register_factored_attention(implementation))
        self.replaced, self.wrapper_holds = implementation, 1
        return True

    def release(self, model: PreTrainedModel, wrapper: bool) -> None:
        """Give back one hold (``wrapper``: one that counted on the wrapper): the last wrapper hold restores the
        implementation it replaced, the last hold removes every hook and record."""
        if wrapper:
            self.wrapper_holds -= 1
            if self.wrapper_holds == 0:
                if model.config._attn_implementation == FACTORED_PREFIX + self.replaced:
                    model.set_attn_implementation(self.replaced)
                self.replaced = None
        self.holds -= 1
        if self.holds == 0:
            for handle in self.handles:
                handle.remove()
            for reference in self.attention:
                module = reference()
                if module is not None:
                    _current_layers.pop(module, None)
                    _current_tokens.pop(module, None)
            _installed.pop(model, None)


# model -> the runtime's hooks on it, while something holds them
_installed: weakref.WeakKeyDictionary[nn.Module, ModelHooks] = weakref.WeakKeyDictionary()


class RuntimeAttention:
    """One hold on a model's runtime hooks (:func:`install_runtime_attention`): :meth:`release` it once, or use it as
    a context manager, to give them back.

    Attributes:
        factored: whether the model runs factored cold attention for the holder (asked for, and the
            model's implementation was sdpa or eager, or already factored).
    """

    def __init__(self, model: PreTrainedModel, hooks: ModelHooks, cache: ServedCache | None, wrapper: bool,
                 factored: bool) -> None:
        self.model, self.hooks, self.wrapper, self.factored = model, hooks, wrapper, factored
        self.cache = None if cache is None else weakref.ref(cache)  # never keeps the cache alive
        self.released = False

    def release(self) -> None:
        """Stop serving the cache and give the hold back (idempotent)."""
        if self.released:
            return
        self.released = True
        cache = None if self.cache is None else self.cache()
        if cache is not None:
            self.hooks.served.discard(cache)
        self.hooks.release(self.model, self.wrapper)

    def release_with(self, owner: object) -> weakref.finalize:
        """Release this hold when ``owner`` is collected; returns the finalizer (call it to release now). The
        finalizer holds this hold, never ``owner``."""
        finalizer = weakref.finalize(owner, self.release)
        finalizer.atexit = False  # at exit the model goes too: nothing to restore
        return finalizer

    def __enter__(self) -> "RuntimeAttention":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


def check_ragged_implementation(implementation: str | None) -> None:
    """A one-line CurKVError unless ``implementation`` can be wrapped to attend over ragged heads (sdpa, eager, or
    their runtime wrapper)."""
    wrapped = implementation[len(FACTORED_PREFIX):] if is_factored(implementation) else implementation
    if wrapped not in WRAPPABLE:
        raise CurKVError(f"allocation='joint' holds a different number of tokens per KV head, which attention "
                         f"implementation {implementation!r} cannot take: load the model with "
                         "attn_implementation='sdpa' or 'eager', or pass TierConfig(allocation='per_head')")


def install_runtime_attention(model: PreTrainedModel, factored: bool = True, per_layer: bool = False,
                              cache: ServedCache | None = None, ragged: bool = False) -> RuntimeAttention:
    """Hold the runtime's hooks on ``model`` (installed by the first hold) and, with ``factored`` or ``per_layer``,
    its attention switched to the wrapper: it attends to cold blocks through their factors and fits the model's
    mask to each layer's held tokens (layers of a cache with a layer budget hold different counts; the model
    builds one mask, for layer 0). With any other implementation than sdpa or eager the hooks are still
    installed and a cache reconstructs its cold blocks.

    Args:
        cache: the cache the hooks serve while the hold lasts (None: only the wrapper's mask fitting, for
            caches compressed elsewhere).
        ragged: the cache's heads hold different counts (joint allocation): the wrapper is required, and attends
            over the layer's ragged storage (:func:`ragged_attention_forward`); refused for other implementations.

    Returns:
        The hold: release it (or leave its ``with`` block) to remove what it installed; one never released
        leaves the model hooked.
    """
    implementation = model.config._attn_implementation
    if ragged:
        check_ragged_implementation(implementation)
    if per_layer and "flex" in (implementation or ""):
        raise CurKVError(f"attention implementation {implementation!r} builds one block mask for layer 0's length, "
                         "and a layer budget holds a different number of tokens in each layer: load the model with "
                         "attn_implementation='sdpa' or 'eager', or pass layer_budget='uniform'")
    per_layer = per_layer or ragged  # joint layers hold different counts: masks fitted per layer
    if (factored or per_layer) and implementation == "eager":
        _eager_function(attention_modules(model)[0])  # a one-line error before anything is installed
    hooks = _installed.get(model)
    if hooks is None:
        hooks = _installed[model] = ModelHooks(model)
    hooks.holds += 1
    if cache is not None:
        hooks.served.add(cache)
    wrapper = (factored or per_layer) and hooks.hold_wrapper(model, factored, per_layer)
    factored = factored and is_factored(model.config._attn_implementation)
    return RuntimeAttention(model, hooks, cache, wrapper, factored)

