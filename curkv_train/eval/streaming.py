"""The streaming task: long held-out documents fed through a cache as generation would see them.

Each document (``stream_text``: CPython's long prose files no training source reads;
``stream_code``: the longest held-out standard-library files of the validation split, spans
shared with the training split cut out) is prefilled for its first ``prefix`` tokens, then fed
``chunk`` tokens at a time (1 = token by token), the cache re-compressing as it does at run
time. The measure is the perplexity (mean NLL per token) over every token after the prefix,
against the full cache's on the same tokens.

Every compressing method runs at the same memory setting: a compression ratio (keep
ratio 1 − ratio, the runtime cache's ``keep_ratio``) or a fixed budget (``max_tokens`` per
(layer, KV head), or ``max_bytes`` for the whole cache, with keep ratio 1.0). The methods:

- ``full``: transformers' DynamicCache, nothing dropped;
- ``streaming_llm``: sinks + the most recent tokens (a :class:`RecencyCache` without tiers,
  observation or layer budget: as many tokens held as ``curkv`` on average over layers, fewer bytes);
- ``curkv``: CurKVCache with the trained scorer at the runtime defaults (dense tiers only, half
  the kept places to the newest tokens, the scorer's calibrated layer budget if it has one);
- ``curkv_uniform``: the same with one keep ratio for every layer (``layer_budget="uniform"``);
- ``curkv_score_only``: the same with every kept place given by the score (``recent_share=0``);
- ``curkv_cold``: + the opt-in cold CUR tier, without residual compensation;
- ``curkv_compensated``: + the cold tier with residual compensation;
- ``recency``: ``curkv``'s cache with score = position: the same tiers, selection, layer budget
  and bytes, the newest tokens kept instead of the best-scored ones (the learned choice against
  recency at equal bytes);
- every further scorer of ``--scorer`` at the runtime defaults (``curkv:LABEL``);
- with ``--kvpress``, kvpress's DecodingPress over a ScorerPress (``kvpress:decoding/NAME``):
  the prefill compressed by the press, then every ``window`` tokens to the tokens
  ``streaming_llm`` holds at that point.

Bytes held are :meth:`CurKVCache.nbytes` (every tier, positions, observation) or the K/V
tensors of a DynamicCache, measured after every step; rows report their mean over the steps
and their value at the end. Intervals resample ``segment``-token stretches of the scored
tokens (paired across methods); stretches of one document are not independent, so they are
narrower than intervals over documents would be.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
from transformers import PreTrainedModel
from transformers.cache_utils import Cache

from curkv_train.core.selection import check_keep_ratio
from curkv_train.errors import CurKVError
from curkv_train.eval import kvpress_bridge
from curkv_train.eval.aggregate import result_row
from curkv_train.eval.cached import (
    RecencyCache,
    feed_chunks,
    held_bytes,
    held_tokens,
    plain_cache,
    prefill_cache,
)
from curkv_train.eval.heldout import (
    PYTHON_TEXT,
    DocumentSource,
    HeldOutDocument,
    held_out_documents,
)
from curkv_train.eval.methods import CURKV_UNIFORM
from curkv_train.eval.metrics import token_nll
from curkv_train.eval.statistics import Bootstrap, paired_difference, verdict
from curkv_train.runtime.cache import CurKVCache
from curkv_train.runtime.tiers import TierSettings
from curkv_train.runtime.scorer import Scorer

# task -> the document source kind it reads
STREAM_TASKS = {"stream_text": PYTHON_TEXT, "stream_code": "stdlib"}
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
MAIN_METRIC = "ppl_increase_pct"


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
    return settings


@dataclass(frozen=True)
class StreamDocument:
    """One document of the streaming task.

    Attributes:
        task: ``stream_text`` or ``stream_code``.
        input_ids: (1, tokens) token ids.
        sources: ids of the held-out documents its tokens came from, in order.
    """

    task: str
    input_ids: torch.Tensor
    sources: tuple[str, ...]


def stream_documents(task: str, held_out: list[HeldOutDocument], *, length: int, count: int) -> list[StreamDocument]:
    """Up to ``count`` documents of ``length`` tokens, as many different files as there are.

    First the blocks of ``length`` tokens that single held-out documents hold, one per document
    (longest document first), then each one's second block, and so on; then what is left (the
    short documents and the long ones' tails, longest first, each ending in EOS) joined and cut
    into blocks.

    Raises:
        CurKVError: the held-out documents hold fewer than ``length`` tokens in all.
    """
    ordered = sorted((doc for doc in held_out if len(doc.tokens)), key=lambda doc: (-len(doc.tokens), doc.id))
    if sum(len(doc.tokens) for doc in ordered) < length:
        raise CurKVError(f"{task}: the held-out documents hold {sum(len(doc.tokens) for doc in ordered)} tokens, "
                         f"fewer than one streamed document of {length}; lower --stream_length")
    whole = sorted(((depth, order) for order, doc in enumerate(ordered) for depth in range(len(doc.tokens) // length)))
    built = [StreamDocument(task, _block(ordered[order].tokens, depth * length, length), (ordered[order].id,))
             for depth, order in whole[:count]]
    rests = sorted(((doc.id, doc.tokens[len(doc.tokens) // length * length :]) for doc in ordered),
                   key=lambda rest: (-len(rest[1]), rest[0]))
    rests = [(name, tokens) for name, tokens in rests if len(tokens)]
    if len(built) < count and rests:
        tokens = np.concatenate([rest for _, rest in rests])
        owners = np.concatenate([np.full(len(rest), index) for index, (_, rest) in enumerate(rests)])
        for start in range(0, min(count - len(built), len(tokens) // length) * length, length):
            sources = tuple(rests[index][0] for index in dict.fromkeys(owners[start : start + length].tolist()))
            built.append(StreamDocument(task, _block(tokens, start, length), sources))
    return built


def _block(tokens: np.ndarray, start: int, length: int) -> torch.Tensor:
    """(1, length) tokens[start : start + length]."""
    return torch.from_numpy(tokens[start : start + length].copy())[None]


def load_stream_documents(tokenizer, tasks: list[str], sources: dict[str, DocumentSource], seen: np.ndarray, *,
                          length: int, count: int) -> dict[str, list[StreamDocument]]:
    """The documents of every streaming task (``sources``: the source each task's kind reads, e.g. the
    recipe's stdlib split; ``seen``: the training split's span hashes, cut out)."""
    return {task: stream_documents(task, held_out_documents(tokenizer, sources[task], seen), length=length,
                                   count=count)
            for task in tasks}


@dataclass
class StreamSettings:
    """How the streaming task runs.

    Attributes:
        memory: the memory settings (ratios and budgets) every compressing method runs at.
        prefix: tokens prefilled at once; the perplexity is over the tokens after them.
        chunk: tokens fed per step after the prefix (1 = token by token).
        segment: scored tokens per bootstrap unit.
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

    def curkv(scorer: Scorer, **tiers) -> Callable[[MemorySetting], StreamRun]:
        return lambda memory: StreamRun(CurKVCache(scorer, model=model, backend=backend, **tiers,
                                                   **memory.cache_options()))

    def recency(**tiers) -> Callable[[MemorySetting], StreamRun]:
        return lambda memory: StreamRun(RecencyCache(carrier, model=model, backend=backend, **tiers,
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
        reference = RecencyCache(carrier, model=model, cold=False, observe=False, layer_budget="uniform",
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


@dataclass
class StreamTrace:
    """What one streamed document gave.

    Attributes:
        nll: (scored,) float64 NLL of every token after the prefix, in order.
        steps: per step, (first scored index it predicted, bytes held, tokens held per (layer, KV head),
            tokens seen) measured after it.
        seconds: wall time of the run.
    """

    nll: np.ndarray
    steps: list[tuple[int, int, float, int]]
    seconds: float


@torch.no_grad()
def stream_document(model: PreTrainedModel, run: StreamRun, input_ids: torch.Tensor, prefix: int,
                    chunk: int) -> StreamTrace:
    """Prefill ``prefix`` tokens of ``input_ids`` (1, tokens) into ``run.cache``, then feed the rest ``chunk`` at
    a time; NLL of every token after the prefix and what the cache held after each step."""
    device = next(model.parameters()).device
    ids = input_ids.to(device)
    total_tokens = ids.shape[1]
    nll: list[torch.Tensor] = []
    steps: list[tuple[int, int, float, int]] = []
    started = time.perf_counter()

    def measure(first: int, seen: int) -> None:
        steps.append((first, held_bytes(run.cache), held_tokens(run.cache), seen))

    def on_step(start: int, stop: int, logits: torch.Tensor) -> None:
        # inputs prefix + [start, stop) predict the tokens one further on
        nll.append(token_nll(logits, ids[:, prefix + start + 1 : prefix + stop + 1])[0].double().cpu())
        measure(start + 1, prefix + stop)
        if run.follow is not None and prefix + stop < total_tokens - 1:
            run.follow(min(prefix + stop + chunk, total_tokens - 1))

    with run.active(model):
        if run.follow is not None:
            run.follow(prefix)
        logits = prefill_cache(model, run.cache, ids[:, :prefix])
        nll.append(token_nll(logits, ids[:, prefix : prefix + 1])[0].double().cpu())
        measure(0, prefix)
        if run.follow is not None:
            run.follow(min(prefix + chunk, total_tokens - 1))
        # the last token predicts nothing scored: inputs stop one short of the end
        feed_chunks(model, run.cache, ids[:, prefix:-1], prefix, chunk, on_step)
    return StreamTrace(torch.cat(nll).numpy(), steps, time.perf_counter() - started)


def segment_sums(trace: StreamTrace, segment: int) -> dict[str, np.ndarray]:
    """Per ``segment`` scored tokens: examples (1), tokens, nll, and the mean over the steps that scored its first
    tokens of the bytes held (kv_bytes), tokens held (kept_tokens) and tokens seen (context_tokens)."""
    count = len(trace.nll)
    bounds = list(range(0, count, segment))
    first = np.asarray([step[0] for step in trace.steps])
    sums: dict[str, list[float]] = {key: [] for key in ("examples", "tokens", "nll", "kv_bytes", "kept_tokens",
                                                       "context_tokens")}
    for start in bounds:
        stop = min(start + segment, count)
        members = [step for step, index in zip(trace.steps, first) if start <= index < stop] or [trace.steps[-1]]
        sums["examples"].append(1.0)
        sums["tokens"].append(float(stop - start))
        sums["nll"].append(float(trace.nll[start:stop].sum()))
        sums["kv_bytes"].append(float(np.mean([step[1] for step in members])))
        sums["kept_tokens"].append(float(np.mean([step[2] for step in members])))
        sums["context_tokens"].append(float(np.mean([step[3] for step in members])))
    return {key: np.asarray(values) for key, values in sums.items()}


def _end(trace: StreamTrace) -> dict[str, float]:
    """Bytes and tokens held after the last step, and their means over the steps."""
    return {"kv_bytes_end": float(trace.steps[-1][1]), "kept_tokens_end": float(trace.steps[-1][2]),
            "kv_bytes_mean": float(np.mean([step[1] for step in trace.steps])),
            "seconds": trace.seconds}


@dataclass
class _Cell:
    """Every document's traces of one (method, setting, task)."""

    sums: list[dict[str, np.ndarray]] = field(default_factory=list)
    ends: list[dict[str, float]] = field(default_factory=list)


def evaluate_streaming(model: PreTrainedModel, documents: dict[str, list[StreamDocument]], methods: list[StreamMethod],
                       settings: StreamSettings, skipped: dict[str, str] | None = None,
                       progress: Callable[[str], None] | None = None, main: str | None = CURKV) -> dict:
    """Stream every document through every method at every memory setting; rows, summary and records.

    Returns:
        {"rows": per (method, setting, task) a results row (:func:`curkv_train.eval.aggregate.result_row`,
        plus ``setting``, the end / mean bytes and the bytes as % of the full cache's), "summary": the main
        scorer against recency and the best other method, "settings", "documents": per task the sources of
        each document, "skipped": {method: why}, "seconds_per_document": {task: float}, "bootstrap",
        "prefix", "chunk", "segment", "length"}.
    """
    skipped = dict(skipped or {})
    cells: dict[tuple[str, str, str], _Cell] = {}
    seconds: dict[str, float] = {}
    for task, task_documents in documents.items():
        started = time.perf_counter()
        for index, document in enumerate(task_documents):
            tick = time.perf_counter()
            for method in methods:
                if method.name in skipped:
                    continue
                memories = [MemorySetting(FULL)] if method.name == FULL else settings.memory
                for memory in memories:
                    try:
                        trace = stream_document(model, method.build(memory), document.input_ids, settings.prefix,
                                                settings.chunk)
                    except Exception as error:
                        if not method.name.startswith(PRESS_PREFIX):
                            raise
                        skipped[method.name] = f"{type(error).__name__}: {(str(error).splitlines() or [''])[0]}"
                        break
                    cell = cells.setdefault((method.name, memory.label, task), _Cell())
                    cell.sums.append(segment_sums(trace, settings.segment))
                    cell.ends.append(_end(trace))
            if progress is not None:
                progress(f"{task} document {index + 1}/{len(task_documents)}: {time.perf_counter() - tick:.1f} s")
        seconds[task] = (time.perf_counter() - started) / max(1, len(task_documents))
    rows = _rows(cells, settings, skipped)
    return {"rows": rows, "summary": summarize_streaming(rows, settings.bootstrap, main=main),
            "settings": [memory.record() for memory in settings.memory],
            "documents": {task: [{"sources": list(document.sources), "tokens": int(document.input_ids.shape[1])}
                                 for document in task_documents] for task, task_documents in documents.items()},
            "skipped": skipped, "seconds_per_document": seconds, "bootstrap": settings.bootstrap.record(),
            "prefix": settings.prefix, "chunk": settings.chunk, "segment": settings.segment}


def _joined(parts: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    return {key: np.concatenate([part[key] for part in parts]) for key in parts[0]}


def _rows(cells: dict[tuple[str, str, str], _Cell], settings: StreamSettings, skipped: dict[str, str]) -> list[dict]:
    """One results row per cell, complete documents only (a press that failed midway has no row)."""
    ratios = {memory.label: memory.ratio for memory in settings.memory}
    rows = []
    for (method, label, task), cell in cells.items():
        full_cell = cells.get((FULL, FULL, task))
        if method in skipped or full_cell is None or len(cell.sums) != len(full_cell.sums):
            continue
        sums, full = _joined(cell.sums), _joined(full_cell.sums)
        tags = [{"document": str(number)} for number, part in enumerate(cell.sums) for _ in part["tokens"]]
        row = result_row(method, ratios.get(label, 0.0 if method == FULL else None), task, "ppl", MAIN_METRIC,
                         sums, full, tags, settings.bootstrap)
        row["setting"] = label
        metrics, intervals = row["metrics"], row["intervals"]
        metrics.pop("kl", None)
        intervals.pop("kl", None)
        metrics["nll"] = float(sums["nll"].sum() / sums["tokens"].sum())
        weights = settings.bootstrap.weights(len(sums["tokens"]), task)
        intervals["nll"] = list(settings.bootstrap.interval((weights @ sums["nll"]) / (weights @ sums["tokens"])))
        full_ends = [end["kv_bytes_end"] for end in full_cell.ends]
        metrics["kv_bytes_end"] = float(np.mean([end["kv_bytes_end"] for end in cell.ends]))
        metrics["kept_tokens_end"] = float(np.mean([end["kept_tokens_end"] for end in cell.ends]))
        metrics["kv_bytes_pct"] = 100.0 * metrics["kv_bytes"] / float(np.mean(full["kv_bytes"]))
        metrics["kv_bytes_end_pct"] = 100.0 * metrics["kv_bytes_end"] / float(np.mean(full_ends))
        metrics["seconds_per_document"] = float(np.mean([end["seconds"] for end in cell.ends]))
        rows.append(row)
    return rows


def summarize_streaming(rows: list[dict], bootstrap: Bootstrap, *, main: str | None) -> list[dict]:
    """Per task and setting: the main scorer's default cache against ``recency`` (equal bytes, the score
    alone differs) and against the best other non-curkv method, paired over the same segments."""
    if not main:
        return []
    table = {(row["method"], row["setting"], row["task"]): row for row in rows}
    entries = []
    for task in dict.fromkeys(row["task"] for row in rows):
        full_row = table.get((FULL, FULL, task))
        if full_row is None:
            continue
        full = {key: np.asarray(value) for key, value in full_row["example_sums"].items()}
        for label in dict.fromkeys(row["setting"] for row in rows if row["method"] != FULL):
            mine = table.get((main, label, task))
            if mine is None:
                continue
            others = [row for (method, setting, name), row in table.items() if setting == label and name == task
                      and method not in (FULL,) and not method.startswith(CURKV)]
            if not others:
                continue
            best = min(others, key=lambda row: row["metrics"][MAIN_METRIC])
            for kind, theirs in (("recency", table.get((RECENCY, label, task))), ("best", best)):
                if theirs is None or (kind == "best" and theirs["method"] == RECENCY):
                    continue
                ours = {key: np.asarray(value) for key, value in mine["example_sums"].items()}
                other = {key: np.asarray(value) for key, value in theirs["example_sums"].items()}
                weights = bootstrap.weights(len(ours["tokens"]), task)
                difference = paired_difference("ppl", MAIN_METRIC, ours, other, full, weights, bootstrap)
                entries.append({"task": task, "setting": label, "against": kind, "method": main,
                                "value": mine["metrics"][MAIN_METRIC], "baseline": theirs["method"],
                                "baseline_value": theirs["metrics"][MAIN_METRIC],
                                "difference": difference.point, "difference_interval": [difference.low,
                                                                                        difference.high],
                                "verdict": verdict(difference, MAIN_METRIC),
                                "bytes_pct": mine["metrics"]["kv_bytes_pct"],
                                "baseline_bytes_pct": theirs["metrics"]["kv_bytes_pct"]})
    return entries


__all__ = ["CURKV", "FULL", "METHODS", "STREAM_TASKS", "MemorySetting", "StreamDocument", "StreamMethod",
           "StreamRun", "StreamSettings", "StreamTrace", "check_memory", "evaluate_streaming", "held_after",
           "load_stream_documents", "memory_settings", "segment_sums", "stream_document", "stream_documents",
           "stream_methods"]
