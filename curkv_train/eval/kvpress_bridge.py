"""Every compressing row of the one-prefill tasks runs a kvpress press inside the context's prefill.

kvpress keeps ``int(n·(1 − r))`` of all n tokens per (layer, KV head); a row's :class:`PressMethod` sets r so
the row keeps our selection's count (sinks + window + ⌈ρ·n_compressible⌉, :func:`press_ratio`), per layer
under a layer budget (kvpress's PerLayerCompressionPress). ``kvpress:<name>`` rows (``--kvpress``) run
kvpress's presses as shipped, at that count or at the ratio as given. Every press drops what it evicts but
AdaKV: it keeps the whole cache and hides the keys it evicts per head (``masked``), so its row continues at once
from its own cache, reports the tokens it leaves visible and holds the full cache's bytes. PyramidKV gives each
layer its own count (the mean is the row's)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from transformers import DynamicCache, PreTrainedModel

from curkv_train.core.errors import CurKVError
from curkv_train.core.observation import attention_modules
from curkv_train.core.shapes import text_config
from curkv_train.core.selection import expected_kept
from curkv_train.eval.clock import clock
from curkv_train.runtime.allocation import LayerBudget

if TYPE_CHECKING:
    from kvpress import BasePress


@dataclass(frozen=True)
class PressSpec:
    """How the harness runs a press: kvpress's class ``cls`` (skipped where this kvpress lacks it) or one of
    :mod:`curkv_train.eval.baseline_presses`; ``eager``: it reads attention weights (the prefill runs eager);
    ``masked``: it hides evicted keys in a whole cache (:func:`masked_kept`) instead of dropping them; ``layered``:
    its layers keep different counts (the model then runs the runtime's mask-fitting attention wrapper);
    ``named_only``: run only where ``--kvpress_presses`` names it (KVzip: two to three prefills per context)."""

    cls: str
    eager: bool = False
    masked: bool = False
    layered: bool = False
    named_only: bool = False


# kvpress's presses (``--kvpress_presses`` names) -> how to run them
PRESSES = {
    "streaming_llm": PressSpec("StreamingLLMPress"),
    "snapkv": PressSpec("SnapKVPress"),
    "tova": PressSpec("TOVAPress"),
    "knorm": PressSpec("KnormPress"),
    "expected_attention": PressSpec("ExpectedAttentionPress"),
    "observed_attention": PressSpec("ObservedAttentionPress", eager=True),
    "cur": PressSpec("CURPress"),
    "leverage": PressSpec("LeverageScorePress"),
    "random": PressSpec("RandomPress"),
    "compactor": PressSpec("CompactorPress"),
    "criticalkv": PressSpec("CriticalKVPress"),
    "keydiff": PressSpec("KeyDiffPress"),
    "lagkv": PressSpec("LagKVPress"),
    "pyramidkv": PressSpec("PyramidKVPress", layered=True),
    "adakv": PressSpec("AdaKVPress", masked=True),
    # its places shared across every layer and head by context reconstruction (masked, as AdaKV); loads the
    # tokenizer from the model's folder and refuses Gemma 3
    "kvzip": PressSpec("KVzipPress", masked=True, named_only=True),
}
# our presses, for the baselines kvpress has no press of
OWN_PRESSES = {"h2o": PressSpec("H2OPress", eager=True)}
# baseline method -> the press it runs (a key of PRESSES or OWN_PRESSES)
BASELINE_PRESSES = {"random": "random", "streaming_llm": "streaming_llm", "h2o": "h2o", "snapkv": "snapkv",
                    "tova": "tova", "knorm": "knorm", "curdkv": "cur", "expected_attention": "expected_attention"}
BUDGETS = ("matched", "nominal")
PREFIX = "kvpress:"


def _kvpress():
    try:
        import kvpress
    except ImportError as error:
        raise CurKVError("the baselines run kvpress's presses: pip install 'curkv-train[kvpress]'") from error
    return kvpress


def available_presses() -> list[str]:
    """Names (keys of :data:`PRESSES`) of the presses the installed kvpress provides."""
    kvpress = _kvpress()
    return [name for name, spec in PRESSES.items() if hasattr(kvpress, spec.cls)]


def select_presses(names: list[str] | None) -> list[str]:
    """The installed presses among ``names`` (None: all but the :attr:`PressSpec.named_only` ones), in
    :data:`PRESSES` order; a CurKVError for another name."""
    installed = available_presses()
    unknown = [name for name in names or [] if name not in installed]
    if unknown:
        raise CurKVError(f"unknown or unavailable kvpress press(es) {', '.join(map(repr, unknown))}; "
                         f"this kvpress provides: {', '.join(installed)}")
    if names is None:
        return [name for name in installed if not PRESSES[name].named_only]
    return [name for name in installed if name in names]


def press_ratio(context_length: int, compression_ratio: float, *, n_sink: int, window: int, budget: str) -> float:
    """The ratio handed to a press for a context of ``context_length`` tokens: ``matched``, the one at which it keeps
    our selection's count at ``compression_ratio``; ``nominal``, ``compression_ratio`` itself."""
    if budget not in BUDGETS:
        raise CurKVError(f"unknown kvpress budget {budget!r}; expected one of {', '.join(BUDGETS)}")
    if budget == "nominal":
        return compression_ratio
    kept = expected_kept(context_length, n_sink, window, 1.0 - compression_ratio)
    return max(0.0, 1.0 - (kept + 0.5) / context_length)  # int(n · (kept + 0.5) / n) == kept, free of truncation


def make_press(name: str, compression_ratio: float, *, n_sink: int, window: int, seed: int | None) -> BasePress:
    """Press ``name`` (of :data:`PRESSES` or :data:`OWN_PRESSES`), its sinks and SnapKV's observation window
    aligned with ours; ``seed`` None: RandomPress draws from the global generator (:func:`press_cache` seeds it).
    CriticalKV wraps ExpectedAttention without the value norm it replaces."""
    if name in OWN_PRESSES:
        from curkv_train.eval import baseline_presses

        return getattr(baseline_presses, OWN_PRESSES[name].cls)(compression_ratio=compression_ratio)
    kvpress = _kvpress()
    if name == "adakv":  # heads of a layer share its places, ranked by ExpectedAttention (kvpress's own pairing)
        return kvpress.AdaKVPress(kvpress.ExpectedAttentionPress(compression_ratio=compression_ratio, n_sink=n_sink))
    if name == "criticalkv":
        return kvpress.CriticalKVPress(kvpress.ExpectedAttentionPress(compression_ratio=compression_ratio,
                                                                      n_sink=n_sink, use_vnorm=False))
    extra = {"streaming_llm": {"n_sink": n_sink}, "expected_attention": {"n_sink": n_sink},
             "cur": {"num_sinks": n_sink}, "snapkv": {"window_size": max(1, window)}, "random": {"seed": seed},
             "lagkv": {"n_sink": n_sink}, "compactor": {"sink_size_start": n_sink}, "kvzip": {"n_sink": n_sink},
             "pyramidkv": {"window_size": max(1, window)}}
    return getattr(kvpress, PRESSES[name].cls)(compression_ratio=compression_ratio, **extra.get(name, {}))


@dataclass(frozen=True)
class PressMethod:
    """A compressing row: how the harness runs its press (``spec``), the press at a compression ratio (``make``:
    (ratio, seed) -> press), the ``layer_budget`` its per-layer counts follow (None: one ratio for every layer),
    and whether it keeps our selection's count (``matched``; False: ``--kvpress_budget`` decides)."""

    spec: PressSpec
    make: Callable[[float, int | None], BasePress]
    layer_budget: LayerBudget | None = None
    matched: bool = True

    def press(self, context_length: int, compression_ratio: float, seed: int | None, *, n_sink: int, window: int,
              budget: str = "matched") -> BasePress:
        """The press for a context of ``context_length`` tokens at ``compression_ratio``; under a layer budget,
        kvpress's PerLayerCompressionPress around it; a one-line CurKVError without kvpress."""
        kvpress, keep = _kvpress(), 1.0 - compression_ratio
        if self.layer_budget is None or keep >= 1.0:
            return self.make(press_ratio(context_length, compression_ratio, n_sink=n_sink, window=window,
                                         budget="matched" if self.matched else budget), seed)
        ratios = [press_ratio(context_length, 1.0 - layer_keep, n_sink=n_sink, window=window, budget="matched")
                  for layer_keep in self.layer_budget.ratios(keep)]
        # it warns that it needs flash attention: the runtime's attention wrapper fits each layer's mask instead
        log = logging.getLogger("kvpress.presses.per_layer_compression_press")
        level = log.level
        log.setLevel(logging.ERROR)
        try:
            return kvpress.PerLayerCompressionPress(self.make(0.0, seed), ratios)
        finally:
            log.setLevel(level)


def baseline_method(name: str, *, n_sink: int, window: int, layer_budget: LayerBudget | None = None) -> PressMethod:
    """Baseline ``name`` (of :data:`BASELINE_PRESSES`): its press's scores with the sinks and the recent window
    kept (:class:`~curkv_train.eval.baseline_presses.ProtectedPress`), the selection of every row."""
    press = BASELINE_PRESSES[name]

    def make(compression_ratio: float, seed: int | None) -> BasePress:
        from curkv_train.eval.baseline_presses import ProtectedPress

        # seed None: the random baseline draws from the global generator, other draws in every layer
        inner = make_press(press, compression_ratio, n_sink=n_sink, window=window, seed=None)
        return ProtectedPress(compression_ratio=compression_ratio, press=inner, n_sink=n_sink, window=window)

    return PressMethod(PRESSES.get(press) or OWN_PRESSES[press], make, layer_budget)


def kvpress_method(name: str, *, n_sink: int, window: int) -> PressMethod:
    """The ``kvpress:<name>`` row: kvpress's press as kvpress ships it (its own protected tokens, if any)."""
    return PressMethod(PRESSES[name], lambda ratio, seed: make_press(name, ratio, n_sink=n_sink, window=window,
                                                                      seed=seed), matched=False)


@contextmanager
def _eager(model: PreTrainedModel, eager: bool) -> Iterator[None]:
    """Run the block with eager attention if ``eager`` (the implementation restored afterwards)."""
    previous = model.config._attn_implementation
    if eager:
        model.set_attn_implementation("eager")
    try:
        yield
    finally:
        if eager:
            model.set_attn_implementation(previous)


@torch.no_grad()
def press_cache(model: PreTrainedModel, spec: PressSpec, press: BasePress, context_ids: torch.Tensor,
                seed: int) -> tuple[DynamicCache, float]:
    """Prefill ``context_ids`` (1, tokens) under ``press`` (run as ``spec`` says): the cache it leaves, and the
    prefill's wall time in seconds (the press's hooks and scores included)."""
    from curkv_train.eval.kvpress_hybrid import on_full_layers

    cache = DynamicCache(config=model.config)
    torch.manual_seed(seed)  # presses that sketch or sample draw from the global generator
    if isinstance(press, _kvpress().PerLayerCompressionPress):
        press.press.post_init_from_model(model)  # kvpress calls the wrapper's own (a no-op), not its press's
    with _eager(model, spec.eager):
        started = clock()
        try:
            with on_full_layers(model, press), press(model):  # a hybrid model's sliding-window layers left whole
                model.get_decoder()(input_ids=context_ids, past_key_values=cache, use_cache=True)
        except ValueError as error:  # kvpress refuses a model it does not support (KVzip: Gemma 3) with one
            raise CurKVError(f"kvpress's {type(press).__name__} refused {type(model).__name__}: {error}") from error
        return cache, clock() - started


def masked_kept(model: PreTrainedModel, cache: DynamicCache) -> float:
    """Mean tokens per (layer, KV head) a masked press leaves visible in the ``cache`` its prefill filled: what each
    layer holds (a hybrid model's sliding-window layers their window), less the keys kvpress hides (recorded per
    attention module, ``masked_key_indices``)."""
    config = text_config(model.config)
    heads = config.num_key_value_heads
    hidden = [len(module.masked_key_indices[0]) for module in attention_modules(model)
              if getattr(module, "masked_key_indices", None) is not None]
    held = sum(layer.keys.shape[2] for layer in cache.layers)
    return held / len(cache.layers) - sum(hidden) / (heads * config.num_hidden_layers)


@torch.no_grad()
def masked_continuation(model: PreTrainedModel, cache: DynamicCache, continuation_ids: torch.Tensor) -> torch.Tensor:
    """Continuation logits (1, M, vocab) float32 from a masked press's ``cache``, a token at a time (kvpress's patch
    hides a key from one step's queries at once; from many it may find no key to hide it with). The masks are then
    cleared: kvpress's patch would otherwise hide the same places in the next cache too."""
    seen, parts = cache.get_seq_length(), []
    try:
        for index in range(continuation_ids.shape[1]):
            positions = torch.tensor([[seen + index]], device=continuation_ids.device)
            output = model(input_ids=continuation_ids[:, index:index + 1], past_key_values=cache, use_cache=True,
                           position_ids=positions)
            parts.append(output.logits.float())
    finally:
        for module in attention_modules(model):
            module.masked_key_indices = None
    return torch.cat(parts, dim=1)
