"""Every compressing row of the one-prefill tasks runs a kvpress press inside the context's prefill.

A press compresses inside the prefill (``with press(model): model(context)``); the
continuation and its scoring are then the same for every row. kvpress keeps
``int(n·(1 − compression_ratio))`` of all n tokens per (layer, KV head). A row's
:class:`PressMethod` sets that ratio so the row keeps exactly our selection's count (sinks +
window + ⌈ρ·n_compressible⌉, :func:`press_ratio`), per layer under a layer budget (kvpress's
``PerLayerCompressionPress``); the ``kvpress:<name>`` rows (``--kvpress``) run kvpress's presses
as kvpress ships them, with ``--kvpress_budget matched`` the same count, with ``nominal`` the
ratio as given. Either way the measured kept tokens and bytes are reported.

Two kinds of press need more than that:

- *Masked* presses (AdaKV, KVzip) keep the whole cache and hide evicted keys from the
  attention through ``module.masked_key_indices`` (kvpress's attention patch), so each
  KV head can keep a different number of tokens. The masks live on the model, not the
  cache: the continuation must run right after the press's own prefill, and the masks
  must be cleared before anything else runs (:func:`masks_cleared`). Their kept tokens
  are the unmasked keys; their memory is not freed.
- *Global* budgets (KVzip) prune ``int(ratio · layers · kv_heads · n)`` keys over all
  layers together, so layers keep different numbers of tokens; matched, the mean per
  (layer, KV head) equals our count.

KVzip scores tokens by how much the model attends to them while it reconstructs the
context (a second pass over a "repeat the previous context" prompt, so 2–3 prefills).
It loads a tokenizer from ``model.config.name_or_path``, which is the converted folder
for the embedded SmolLM2 (it has a chat template), a hub id for a hub model (a network
call) and empty for the tiny random model; :func:`press_cache` points it at a local copy
of the evaluation's tokenizer for the duration of the press, without a chat template,
because our contexts are plain text, not chat turns (with one, KVzip would take the
template's system prefix to be the context's first tokens and never score them).
"""

from __future__ import annotations

import copy
import logging
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel

from curkv_train.core.errors import CurKVError
from curkv_train.core.observation import attention_modules
from curkv_train.core.selection import expected_kept
from curkv_train.eval.clock import clock
from curkv_train.runtime.allocation import LayerBudget


@dataclass(frozen=True)
class PressSpec:
    """How the harness runs one kvpress press.

    Attributes:
        cls: kvpress class name (the press is skipped where the installed kvpress lacks it), or the name of
            a press of :mod:`curkv_train.eval.baseline_presses` (``h2o``: kvpress has no such press).
        eager: reads attention weights, so the prefill runs with eager attention.
        masked: keeps the full cache and masks evicted keys (fake compression).
        global_budget: the compression ratio counts keys over all layers together.
        reads_tokenizer: loads a tokenizer from ``model.config.name_or_path``.
        single_pass: scores from the one prefill; False for presses that run further passes over the
            context (KVzip reconstructs it), reported beside the verdict but never its baseline.
    """

    cls: str
    eager: bool = False
    masked: bool = False
    global_budget: bool = False
    reads_tokenizer: bool = False
    single_pass: bool = True


# our name -> how to run it
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
    "adakv": PressSpec("AdaKVPress", masked=True),
    "kvzip": PressSpec("KVzipPress", masked=True, global_budget=True, reads_tokenizer=True, single_pass=False),
}
# presses of ours (curkv_train.eval.baseline_presses), for the baselines kvpress has no press of
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
        raise CurKVError("--kvpress needs the kvpress package: pip install 'curkv-train[kvpress]'") from error
    return kvpress


def available_presses() -> list[str]:
    """Names (keys of :data:`PRESSES`) of the presses the installed kvpress provides."""
    kvpress = _kvpress()
    return [name for name, spec in PRESSES.items() if hasattr(kvpress, spec.cls)]


def select_presses(names: list[str] | None) -> list[str]:
    """The installed presses among ``names`` (None: every installed one), in :data:`PRESSES` order;
    a CurKVError for a name that is not a known press or that this kvpress lacks."""
    installed = available_presses()
    if names is None:
        return installed
    unknown = [name for name in names if name not in installed]
    if unknown:
        raise CurKVError(f"unknown or unavailable kvpress press(es) {', '.join(map(repr, unknown))}; "
                         f"this kvpress provides: {', '.join(installed)}")
    return [name for name in installed if name in names]


def multi_pass_methods(names: list[str]) -> list[str]:
    """The method names (``kvpress:NAME``) of the presses among ``names`` that take more than one pass."""
    return [PREFIX + name for name in names if not PRESSES[name].single_pass]


def masked_presses() -> list[str]:
    """Names of the presses that mask keys instead of dropping them (their memory is not freed)."""
    return [name for name, spec in PRESSES.items() if spec.masked]


def press_ratio(context_length: int, compression_ratio: float, *, n_sink: int, window: int, budget: str,
                pooled_heads: int = 1) -> float:
    """The compression ratio handed to a kvpress press for a context of ``context_length`` tokens.

    Args:
        pooled_heads: (layer, KV head) pairs a global budget pools (layers × KV heads); 1 for
            presses that keep ``int(n·(1 − r))`` per (layer, KV head).
    """
    if budget not in BUDGETS:
        raise CurKVError(f"unknown kvpress budget {budget!r}; expected one of {', '.join(BUDGETS)}")
    if budget == "nominal":
        return compression_ratio
    kept = expected_kept(context_length, n_sink, window, 1.0 - compression_ratio)
    if pooled_heads > 1:
        # int(units · n · r) == units · (n − kept) pruned keys, free of float truncation
        return (pooled_heads * (context_length - kept) + 0.5) / (pooled_heads * context_length)
    # int(n · (kept + 0.5) / n) == kept, free of float truncation
    return max(0.0, 1.0 - (kept + 0.5) / context_length)


@contextmanager
def _quiet(logger: str) -> Iterator[None]:
    """Warnings of ``logger`` silenced inside the block (errors still shown)."""
    log = logging.getLogger(logger)
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def make_press(name: str, compression_ratio: float, *, n_sink: int, window: int, seed: int | None):
    """Press ``name`` (a key of :data:`PRESSES` or :data:`OWN_PRESSES`) with its hyper-parameters aligned with
    ours (sinks, SnapKV's observation window = ``window``); ``seed`` None: RandomPress draws from the global
    generator (:func:`press_cache` seeds it).

    AdaKV and CriticalKV wrap ExpectedAttention (CriticalKV without its value norm, which
    CriticalKV replaces by the norm of the projected values).
    """
    if name in OWN_PRESSES:
        from curkv_train.eval import baseline_presses

        return getattr(baseline_presses, OWN_PRESSES[name].cls)(compression_ratio=compression_ratio)
    kvpress = _kvpress()
    if name == "adakv":
        return kvpress.AdaKVPress(kvpress.ExpectedAttentionPress(compression_ratio=compression_ratio, n_sink=n_sink))
    if name == "criticalkv":
        return kvpress.CriticalKVPress(kvpress.ExpectedAttentionPress(compression_ratio=compression_ratio,
                                                                      n_sink=n_sink, use_vnorm=False))
    extra = {"streaming_llm": {"n_sink": n_sink}, "expected_attention": {"n_sink": n_sink},
             "cur": {"num_sinks": n_sink}, "snapkv": {"window_size": max(1, window)}, "random": {"seed": seed},
             "kvzip": {"n_sink": n_sink}, "lagkv": {"n_sink": n_sink}, "compactor": {"sink_size_start": n_sink}}
    with _quiet("kvpress.presses.kvzip_press"):  # KVzip warns of its 2-3 prefills; the harness reports their time
        return getattr(kvpress, PRESSES[name].cls)(compression_ratio=compression_ratio, **extra.get(name, {}))


@dataclass(frozen=True)
class PressMethod:
    """A compressing row: the press it runs and the tokens it is given.

    Attributes:
        spec: how the harness runs the press (eager attention, masks, a global budget).
        make: (compression ratio, seed) -> the press at that ratio.
        layer_budget: the layer budget the row's per-layer counts follow (kvpress's PerLayerCompressionPress);
            None: one ratio for every layer.
        matched: given our selection's count (sinks + window + ⌈ρ·n_compressible⌉ per (layer, KV head));
            False: the run's ``--kvpress_budget`` decides.
    """

    spec: PressSpec
    make: Callable[[float, int | None], object]
    layer_budget: LayerBudget | None = None
    matched: bool = True

    def press(self, context_length: int, compression_ratio: float, seed: int | None, *, n_sink: int, window: int,
              budget: str = "matched", pooled_heads: int = 1):
        """The press for a context of ``context_length`` tokens at ``compression_ratio`` (``pooled_heads``:
        layers × KV heads, read by presses with a global budget)."""
        budget = "matched" if self.matched else budget
        keep = 1.0 - compression_ratio
        if self.layer_budget is None or keep >= 1.0:
            return self.make(press_ratio(context_length, compression_ratio, n_sink=n_sink, window=window,
                                         budget=budget, pooled_heads=pooled_heads if self.spec.global_budget else 1),
                             seed)
        ratios = [press_ratio(context_length, 1.0 - layer_keep, n_sink=n_sink, window=window, budget="matched")
                  for layer_keep in self.layer_budget.ratios(keep)]
        # it warns that it needs flash attention: the runtime's attention wrapper fits each layer's mask instead
        with _quiet("kvpress.presses.per_layer_compression_press"):
            return _kvpress().PerLayerCompressionPress(self.make(0.0, seed), ratios)


def baseline_method(name: str, *, n_sink: int, window: int, layer_budget: LayerBudget | None = None) -> PressMethod:
    """Baseline ``name`` (a key of :data:`BASELINE_PRESSES`): its press's scores with the sinks and the recent
    window kept (:class:`~curkv_train.eval.baseline_presses.ProtectedPress`), the selection of every row."""
    press = BASELINE_PRESSES[name]
    spec = PRESSES.get(press) or OWN_PRESSES[press]

    def make(compression_ratio: float, seed: int | None):
        from curkv_train.eval.baseline_presses import ProtectedPress

        # the random baseline draws from the global generator: other draws in every layer
        inner = make_press(press, compression_ratio, n_sink=n_sink, window=window, seed=None)
        return ProtectedPress(compression_ratio=compression_ratio, press=inner, n_sink=n_sink, window=window)

    return PressMethod(spec, make, layer_budget)


def kvpress_method(name: str, *, n_sink: int, window: int) -> PressMethod:
    """kvpress's press ``name`` as kvpress ships it (its own protected tokens, if any), the ``kvpress:<name>`` row."""
    return PressMethod(PRESSES[name], lambda ratio, seed: make_press(name, ratio, n_sink=n_sink, window=window,
                                                                      seed=seed), matched=False)


@dataclass
class PressedCache:
    """The cache a press left after its prefill.

    Attributes:
        cache: the (compressed or, for masked presses, full) cache.
        kept_tokens: mean keys per (layer, KV head) the continuation attends to (unmasked).
        masked: the cache is full and the attention masks live on the model until cleared.
        prefill_seconds: wall time of the press's prefill (KVzip's reconstruction included).
    """

    cache: DynamicCache
    kept_tokens: float
    masked: bool
    prefill_seconds: float


def masked_key_counts(model: PreTrainedModel) -> list[int]:
    """Keys masked per layer (all KV heads together) by the last masked press; 0 where none."""
    counts = []
    for module in attention_modules(model):
        indices = getattr(module, "masked_key_indices", None)
        counts.append(0 if indices is None else int(indices[0].numel()))
    return counts


def clear_masks(model: PreTrainedModel) -> None:
    """Forget every layer's masked keys, so later continuations see their whole cache."""
    for module in attention_modules(model):
        if getattr(module, "masked_key_indices", None) is not None:
            module.masked_key_indices = None


@torch.no_grad()
def masked_continuation_logits(model: PreTrainedModel, cache: DynamicCache, continuation_ids: torch.Tensor,
                               context_length: int) -> torch.Tensor:
    """Logits (1, M, vocab) float32 of ``continuation_ids`` (1, M) over a masked press's cache, one token at a time.

    kvpress hides a masked key by overwriting it with a fake key that every query of the
    forward pass scores near −inf (``search_hyperplane``); one such key for all M
    continuation queries of a KV head often does not exist, one per decoding step does
    (as in kvpress's own generation). ``cache`` is extended in place.
    """
    held = cache.get_seq_length()
    device = continuation_ids.device
    logits = []
    for step in range(continuation_ids.shape[1]):
        try:
            output = model(input_ids=continuation_ids[:, step : step + 1], past_key_values=cache, use_cache=True,
                           position_ids=torch.tensor([[context_length + step]], device=device),
                           cache_position=torch.tensor([held + step], device=device))
        except ValueError as error:
            raise CurKVError(f"kvpress could not mask the evicted keys at continuation step {step} ({error}); "
                             "run without --kvpress") from error
        logits.append(output.logits.float())
    return torch.cat(logits, dim=1)


@contextmanager
def masks_cleared(model: PreTrainedModel) -> Iterator[None]:
    """Run the block with the masks a press left, then clear them (also on error)."""
    try:
        yield
    finally:
        clear_masks(model)


@contextmanager
def _local_tokenizer(model: PreTrainedModel, tokenizer) -> Iterator[None]:
    """``model.config.name_or_path`` points at a saved copy of ``tokenizer`` (no chat template) inside the block."""
    if tokenizer is None:
        raise CurKVError("kvpress's KVzip reads the evaluation's tokenizer: pass tokenizer= to evaluate")
    plain = copy.deepcopy(tokenizer)
    plain.chat_template = None
    previous = model.config.name_or_path
    with tempfile.TemporaryDirectory(prefix="curkv-kvzip-") as folder:
        plain.save_pretrained(folder)
        model.config.name_or_path = folder
        try:
            yield
        finally:
            model.config.name_or_path = previous


@contextmanager
def _attention(model: PreTrainedModel, implementation: str | None) -> Iterator[None]:
    """Run the block with attention ``implementation`` (None: unchanged), restored afterwards."""
    previous = model.config._attn_implementation
    if implementation is not None:
        model.set_attn_implementation(implementation)
    try:
        yield
    finally:
        if implementation is not None:
            model.set_attn_implementation(previous)


@torch.no_grad()
def press_cache(model: PreTrainedModel, spec: PressSpec, press, context_ids: torch.Tensor, seed: int,
                tokenizer=None) -> PressedCache:
    """Prefill ``context_ids`` (1, tokens) under ``press`` (run as ``spec`` says); the cache it leaves and what it keeps.

    Presses that read attention weights run with eager attention, restored afterwards. After a
    masked press the masks stay on the model for the continuation: run it inside
    :func:`masks_cleared`.
    """
    cache = DynamicCache(config=model.config)
    torch.manual_seed(seed)  # presses that sketch or sample draw from the global generator
    clear_masks(model)
    if isinstance(press, _kvpress().PerLayerCompressionPress):
        press.press.post_init_from_model(model)  # kvpress calls the wrapper's own (a no-op), not its press's
    tokenizer_scope = _local_tokenizer(model, tokenizer) if spec.reads_tokenizer else nullcontext()
    with _attention(model, "eager" if spec.eager else None), tokenizer_scope:
        started = clock()  # the press's own work: its hooks, KVzip's reconstruction and tokenizer load
        with press(model):
            model.get_decoder()(input_ids=context_ids, past_key_values=cache, use_cache=True)
        seconds = clock() - started
    kept = sum(layer.keys.shape[2] for layer in cache.layers) / len(cache.layers)
    if spec.masked:
        kv_heads = cache.layers[0].keys.shape[1]
        kept -= sum(masked_key_counts(model)) / (len(cache.layers) * kv_heads)
    return PressedCache(cache, kept, spec.masked, seconds)
