"""The streaming task's rows: which caches it compares, at which memory setting, and how each is built.

See :mod:`curkv_train.eval.streaming` for the task and the meaning of every row."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field

from transformers import PreTrainedModel
from transformers.cache_utils import Cache

from curkv_train.core.selection import check_keep_ratio
from curkv_train.core.errors import CurKVError
from curkv_train.eval import kvpress_bridge
from curkv_train.eval.runtime_caches import RecencyCache, plain_cache
from curkv_train.eval.methods import CURKV_UNIFORM
from curkv_train.eval.statistics import Bootstrap
from curkv_train.runtime.cache import CurKVCache
from curkv_train.runtime.cache_config import ComputeConfig, TierConfig
from curkv_train.runtime.scorer import Scorer
from curkv_train.runtime.tiers import TierSettings

FULL, STREAMING_LLM, CURKV, CURKV_SCORE_ONLY, CURKV_COLD, CURKV_COMPENSATED, RECENCY = (
    "full", "streaming_llm", "curkv", "curkv_score_only", "curkv_cold", "curkv_compensated", "recency")
METHODS = (FULL, STREAMING_LLM, CURKV, CURKV_UNIFORM, CURKV_SCORE_ONLY, CURKV_COLD, CURKV_COMPENSATED, RECENCY)
PRESS_PREFIX = "kvpress:decoding/"
# ScorerPresses DecodingPress runs over (names of kvpress_bridge.PRESSES), and those it cannot, with why
DECODING_PRESSES = ("expected_attention", "snapkv", "knorm")
UNSUPPORTED_PRESSES = {
    "curkv": "CurKVPress scores positions 0..n-1, and a DynamicCache a press compressed no longer records the "
             "true positions of its tokens (the runtime CurKVCache is the decoding-time path of the scorer)",
}


@dataclass(frozen=True)
class MemorySetting:
    """One memory setting every compressing method runs at.

    Attributes:
        label: the column label (``0.5``, ``512 tokens``, ``2.0 MiB``).
        keep_ratio: the runtime cache's keep ratio ρ (1.0 under a fixed budget).
        max_tokens, max_bytes: the fixed budget, or None.
        ratio: the compression ratio 1 − ρ of a ratio setting, None for a budget.
    """

    label: str
    keep_ratio: float = 1.0
    max_tokens: int | None = None
    max_bytes: int | None = None
    ratio: float | None = None

    def cache_options(self) -> dict:
        """CurKVCache keyword arguments of this setting."""
        return {"keep_ratio": self.keep_ratio, "max_tokens": self.max_tokens, "max_bytes": self.max_bytes}

    def record(self) -> dict:
        """The setting as a plain dict (results.json)."""
        return asdict(self)


def memory_settings(ratios: list[float], budget_tokens: list[int] | None = None,
                    budget_bytes: list[int] | None = None) -> list[MemorySetting]:
    """Ratio settings, then token budgets, then byte budgets (one-line errors for values out of range)."""
    settings = []
    for ratio in ratios:
        if not 0.0 <= ratio < 1.0:
            raise CurKVError(f"compression ratios must lie in [0, 1), got {ratio}")
        settings.append(MemorySetting(f"{ratio:g}", check_keep_ratio(1.0 - ratio), ratio=ratio))
    for tokens in budget_tokens or []:
        if tokens < 1:
            raise CurKVError(f"--budget_tokens must be positive, got {tokens}")
        settings.append(MemorySetting(f"{tokens} tokens", max_tokens=tokens))
    for size in budget_bytes or []:
        if size < 1:
            raise CurKVError(f"--budget_bytes must be positive, got {size}")
        settings.append(MemorySetting(f"{size / 2**20:.3g} MiB", max_bytes=size))
    if not settings:
        raise CurKVError("the streaming task needs a compression ratio or a budget (--ratios, --budget_tokens, "
                         "--budget_bytes)")
    labels = [setting.label for setting in settings]
    if len(set(labels)) != len(labels):  # one results cell per label: a repeat would drop rows
        raise CurKVError(f"memory settings repeat ({', '.join(labels)}); give each ratio or budget once")
    return settings


@dataclass
class StreamSettings:
    """How the streaming task runs.

    Attributes:
        memory: the memory settings (ratios and budgets) every compressing method runs at.
        prefix: tokens prefilled at once; the perplexity is over the tokens after them.
        chunk: tokens fed per step after the prefix (1 = token by token).
        segment: scored tokens per recorded segment (the bootstrap resamples whole documents).
        backend: compaction / factored-attention kernel backend.
        kvpress: also run kvpress's DecodingPress rows.
        seed: bootstrap and press seed.
        resamples: bootstrap resamples.
    """

    memory: list[MemorySetting]
    prefix: int = 1024
    chunk: int = 64
    segment: int = 512
    backend: str = "auto"
    kvpress: bool = False
    seed: int = 0
    resamples: int = 2000
    bootstrap: Bootstrap = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.prefix < 1 or self.chunk < 1 or self.segment < 1:
            raise CurKVError(f"--stream_prefix, --stream_chunk and --stream_segment must be at least 1, got "
                             f"{self.prefix}, {self.chunk} and {self.segment}")
        self.bootstrap = Bootstrap(resamples=self.resamples, seed=self.seed)

    def check_length(self, length: int, max_positions: int | None) -> None:
        """A CurKVError unless documents of ``length`` tokens leave tokens after the prefix and fit the model."""
        if length <= self.prefix:
            raise CurKVError(f"--stream_length {length} must exceed --stream_prefix {self.prefix} (the perplexity "
                             "is over the tokens after the prefix)")
        if max_positions and length > max_positions:
            raise CurKVError(f"--stream_length {length} exceeds the model's {max_positions} positions")


@dataclass
class StreamRun:
    """A cache to stream through, and what runs around it.

    Attributes:
        cache: the cache the model is handed.
        press: a kvpress press active during the whole document (``with press(model)``), or None.
        follow: told the tokens seen once the coming step is in (a press's target follows it), or None.
    """

    cache: Cache
    press: object | None = None
    follow: Callable[[int], None] | None = None

    @contextlib.contextmanager
    def active(self, model: PreTrainedModel) -> Iterator[None]:
        """The press (if any) on ``model`` for the duration of the block."""
        with self.press(model) if self.press is not None else contextlib.nullcontext():
            yield


@dataclass
class StreamMethod:
    """A streaming method: its name and how to build its run at a memory setting (``full`` ignores it)."""

    name: str
    build: Callable[[MemorySetting], StreamRun]


def held_after(settings: TierSettings, seen: int) -> int:
    """Tokens per (layer, KV head) a CurKVCache with ``settings`` holds right after compressing at ``seen``."""
    protected = settings.n_sink + settings.hot_tokens
    if seen <= protected:
        return seen
    return protected + settings.target(seen - protected, seen)


def stream_methods(model: PreTrainedModel, scorers: dict[str, Scorer], carrier: Scorer, settings: StreamSettings, *,
                   main: str | None) -> tuple[list[StreamMethod], dict[str, str]]:
    """Every streaming method, and the optional rows that cannot run with why.

    Args:
        scorers: the trained scorers by method name (``curkv``, ``curkv:LABEL``); the first is the main one.
        carrier: the scorer whose spans and observation the recency caches copy (the main scorer, or a
            fresh one without a scorer).
        main: the main scorer's method name (``curkv`` or ``curkv:LABEL``), or None without a scorer.
    """
    backend = settings.backend
    suffix = main[len(CURKV):] if main else ""

    def curkv(scorer: Scorer, layer_budget: str = "scorer", **tiers) -> Callable[[MemorySetting], StreamRun]:
        return lambda memory: StreamRun(CurKVCache(scorer, model=model, layer_budget=layer_budget,
                                                   tiers=TierConfig(**tiers), compute=ComputeConfig(backend=backend),
                                                   **memory.cache_options()))

    def recency(observe: bool = True, layer_budget: str = "scorer", **tiers) -> Callable[[MemorySetting], StreamRun]:
        return lambda memory: StreamRun(RecencyCache(carrier, model=model, observe=observe, layer_budget=layer_budget,
                                                     tiers=TierConfig(**tiers), compute=ComputeConfig(backend=backend),
                                                     **memory.cache_options()))

    methods = [StreamMethod(FULL, lambda memory: StreamRun(plain_cache(model))),
               StreamMethod(STREAMING_LLM, recency(cold=False, observe=False, layer_budget="uniform"))]
    if main:
        scorer = scorers[main]
        methods += [StreamMethod(main, curkv(scorer)),
                    StreamMethod(CURKV_UNIFORM + suffix, curkv(scorer, layer_budget="uniform")),
                    StreamMethod(CURKV_SCORE_ONLY + suffix, curkv(scorer, recent_share=0.0)),
                    StreamMethod(CURKV_COLD + suffix, curkv(scorer, cold=True, compensation=False)),
                    StreamMethod(CURKV_COMPENSATED + suffix, curkv(scorer, cold=True))]
    methods.append(StreamMethod(RECENCY, recency()))
    methods += [StreamMethod(name, curkv(scorer)) for name, scorer in scorers.items() if name != main]
    skipped = {}
    if settings.kvpress:
        methods += [StreamMethod(PRESS_PREFIX + name, _press_builder(model, carrier, name, settings))
                    for name in DECODING_PRESSES if name in kvpress_bridge.available_presses()]
        skipped = {PRESS_PREFIX + name: reason for name, reason in UNSUPPORTED_PRESSES.items()}
    return methods, skipped


def select_rows(methods: list[StreamMethod], names: list[str] | None) -> list[StreamMethod]:
    """The methods named in ``names`` (all if None), ``full`` always (every row is measured against it);
    a one-line CurKVError for a name no method has."""
    if not names:
        return methods
    available = [method.name for method in methods]
    unknown = [name for name in names if name not in available]
    if unknown:
        raise CurKVError(f"unknown streaming row(s) {', '.join(map(repr, unknown))}; this run has: "
                         f"{', '.join(available)}")
    return [method for method in methods if method.name == FULL or method.name in names]


def check_memory(model: PreTrainedModel, scorers: dict[str, Scorer], carrier: Scorer,
                 settings: StreamSettings) -> None:
    """A one-line CurKVError, before anything runs, for a memory setting some cache cannot hold
    (a budget below the sinks, hot tier and a window of arrivals of a scorer's spans)."""
    for memory in settings.memory:
        for name, scorer in {"the recency caches": carrier, **scorers}.items():
            for cls in (CurKVCache, RecencyCache):
                try:
                    cls(scorer, model=model, **memory.cache_options())
                except CurKVError as error:
                    raise CurKVError(f"streaming setting {memory.label} for {name}: {error}") from None


def _press_builder(model: PreTrainedModel, carrier: Scorer, name: str,
                   settings: StreamSettings) -> Callable[[MemorySetting], StreamRun]:
    """kvpress's PrefillDecodingPress: the prefill compressed by ScorerPress ``name``, then DecodingPress over
    it every compression interval, each time to the tokens ``streaming_llm`` holds after the same step."""
    from kvpress import DecodingPress, PrefillDecodingPress

    class FollowingDecodingPress(DecodingPress):
        """DecodingPress whose target size is read when it compresses (it follows the tokens seen)."""

        target: Callable[[], int] = staticmethod(lambda: 2048)

        def _resolve_target_size(self, kwargs: dict) -> int:
            return max(1, self.target())

        def compress(self, module, hidden_states, keys, values, attentions, kwargs):
            # a short last chunk gives SnapKV fewer queries (or, with an interval of several chunks, fewer
            # rotary positions: kvpress passes only the last step's) than its window: keep everything
            window = getattr(self.base_press, "window_size", 0)
            step_positions = kwargs["position_embeddings"][0].shape[-2] if "position_embeddings" in kwargs else window
            if hidden_states.shape[1] <= window or step_positions < window:
                return keys, values
            return super().compress(module, hidden_states, keys, values, attentions, kwargs)

    def build(memory: MemorySetting) -> StreamRun:
        reference = RecencyCache(carrier, model=model, observe=False, layer_budget="uniform",
                                 **memory.cache_options()).settings
        prefix = settings.prefix
        prefill_ratio = max(0.0, 1.0 - (held_after(reference, prefix) + 0.5) / prefix)  # int(n·(1 − r)) kept
        seen = {"after": prefix}
        interval = max(1, reference.interval // settings.chunk)
        # at a compression the press sees the hidden states of the steps since the last one (SnapKV's window
        # must be shorter than them)
        observed = min(reference.window, max(1, interval * settings.chunk - 1))
        decoding = FollowingDecodingPress(
            base_press=kvpress_bridge.make_press(name, 0.0, n_sink=reference.n_sink, window=observed,
                                                 seed=settings.seed),
            compression_interval=interval)
        decoding.target = lambda: held_after(reference, seen["after"])
        press = PrefillDecodingPress(
            prefilling_press=kvpress_bridge.make_press(name, prefill_ratio, n_sink=reference.n_sink,
                                                       window=reference.window, seed=settings.seed),
            decoding_press=decoding)
        return StreamRun(plain_cache(model), press, lambda after: seen.__setitem__("after", after))

    return build
