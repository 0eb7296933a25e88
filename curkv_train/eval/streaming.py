"""The streaming task: long held-out documents fed through a cache as generation would see them.

Each document (``stream_text``: CPython's prose files no training source reads; ``stream_code``: the
longest held-out standard-library files) is prefilled for its first ``prefix`` tokens, then fed
``chunk`` tokens at a time; the measure is the perplexity over every token after the prefix against
the full cache's. Every compressing row runs at each memory setting: a compression ratio (the runtime
cache's keep ratio 1 − ratio) or a budget (``max_tokens`` per (layer, KV head), ``max_bytes`` in all).
Rows (:func:`~curkv_train.eval.stream_rows.stream_methods`): ``full`` (a DynamicCache);
``streaming_llm`` (sinks + newest tokens, a :class:`RecencyCache` without observation or layer budget);
``curkv`` (CurKVCache with the trained scorer at the runtime defaults) and its variants
``curkv_uniform`` (one keep ratio for every layer), ``curkv_score_only`` (``recent_share=0``),
``curkv_cold`` / ``curkv_compensated`` (+ the cold CUR tier without / with compensation); ``recency``
(``curkv``'s cache with score = position: same tiers, budget and bytes); every further scorer
(``curkv:LABEL``). kvpress's presses compress once, in the prefill: they run in the one-prefill tasks.
Bytes held (``CurKVCache.nbytes`` or the K/V tensors) are measured after every step; intervals resample
held-out files, each file's ``segment``-token stretches drawn together.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from transformers import PreTrainedModel
from transformers.cache_utils import Cache

from curkv_train.eval.heldout import StreamDocument
from curkv_train.eval.metrics import token_nll
from curkv_train.eval.runtime_caches import feed_chunks, held_bytes, held_tokens, prefill_cache
from curkv_train.eval.statistics import Bootstrap, paired_difference, result_row, verdict
from curkv_train.eval.stream_rows import CURKV, FULL, RECENCY, MemorySetting, StreamMethod, StreamSettings

MAIN_METRIC = "ppl_increase_pct"


@dataclass
class StreamTrace:
    """One streamed document: ``nll`` (scored,) float64 of every token after the prefix; per step, ``steps``
    (first scored index it predicted, bytes held, tokens held per (layer, KV head), tokens seen); ``seconds``."""

    nll: np.ndarray
    steps: list[tuple[int, int, float, int]]
    seconds: float


@torch.no_grad()
def stream_document(model: PreTrainedModel, cache: Cache, input_ids: torch.Tensor, prefix: int,
                    chunk: int) -> StreamTrace:
    """Prefill ``prefix`` tokens of ``input_ids`` (1, tokens) into ``cache``, then feed the rest ``chunk`` at a time;
    NLL of every token after the prefix and what the cache held after each step."""
    ids = input_ids.to(next(model.parameters()).device)
    nll: list[torch.Tensor] = []
    steps: list[tuple[int, int, float, int]] = []
    started = time.perf_counter()

    def on_step(start: int, stop: int, logits: torch.Tensor) -> None:
        # inputs prefix + [start, stop) predict the tokens one further on
        nll.append(token_nll(logits, ids[:, prefix + start + 1 : prefix + stop + 1])[0].double().cpu())
        steps.append((start + 1, held_bytes(cache), held_tokens(cache), prefix + stop))

    logits = prefill_cache(model, cache, ids[:, :prefix])
    nll.append(token_nll(logits, ids[:, prefix : prefix + 1])[0].double().cpu())
    steps.append((0, held_bytes(cache), held_tokens(cache), prefix))
    feed_chunks(model, cache, ids[:, prefix:-1], prefix, chunk, on_step)  # the last token predicts nothing scored
    return StreamTrace(torch.cat(nll).numpy(), steps, time.perf_counter() - started)


def segment_sums(trace: StreamTrace, segment: int) -> dict[str, np.ndarray]:
    """Per ``segment`` scored tokens: examples (1), tokens, nll, and the mean over the steps that scored its tokens
    of the bytes held (kv_bytes), tokens held (kept_tokens) and tokens seen (context_tokens): the steps that
    start in the segment, or (a chunk longer than a segment) the step that scored its first token."""
    count, first = len(trace.nll), np.asarray([step[0] for step in trace.steps])
    segments = []
    for start in range(0, count, segment):
        stop = min(start + segment, count)
        members = ([step for step, index in zip(trace.steps, first) if start <= index < stop]
                   or [trace.steps[int(np.searchsorted(first, start, side="right")) - 1]])
        held = np.mean([step[1:] for step in members], axis=0)  # bytes, tokens held, tokens seen
        segments.append([1.0, float(stop - start), float(trace.nll[start:stop].sum()), *held])
    keys = ("examples", "tokens", "nll", "kv_bytes", "kept_tokens", "context_tokens")
    return {key: column.astype(np.float64) for key, column in zip(keys, np.asarray(segments).T)}


def evaluate_streaming(model: PreTrainedModel, documents: dict[str, list[StreamDocument]], methods: list[StreamMethod],
                       settings: StreamSettings, progress: Callable[[str], None] | None = None,
                       main: str | None = CURKV) -> dict:
    """Stream every document through every method at every memory setting.

    Returns:
        {"rows": per (method, setting, task) a results row (:func:`~curkv_train.eval.statistics.result_row`, plus
        ``setting`` and the bytes held), "summary" (:func:`summarize_streaming`), "settings", "documents",
        "seconds_per_document", "bootstrap", "prefix", "chunk", "segment"}.
    """
    cells: dict[tuple[str, str, str], list[StreamTrace]] = {}
    seconds: dict[str, float] = {}
    for task, task_documents in documents.items():
        started = time.perf_counter()
        for index, document in enumerate(task_documents):
            tick = time.perf_counter()
            for method in methods:
                for memory in [MemorySetting(FULL)] if method.name == FULL else settings.memory:
                    trace = stream_document(model, method.build(memory), document.input_ids, settings.prefix,
                                            settings.chunk)
                    cells.setdefault((method.name, memory.label, task), []).append(trace)
            if progress is not None:
                progress(f"{task} document {index + 1}/{len(task_documents)}: {time.perf_counter() - tick:.1f} s")
        seconds[task] = (time.perf_counter() - started) / max(1, len(task_documents))
    # the bootstrap's unit: a document's file (a long file gives several streamed documents, not independent)
    units = {task: [document.sources[0] if document.sources else str(index)
                    for index, document in enumerate(task_documents)] for task, task_documents in documents.items()}
    rows = _rows(cells, settings, units)
    return {"rows": rows, "summary": summarize_streaming(rows, settings.bootstrap, main=main),
            "settings": [memory.record() for memory in settings.memory],
            "documents": {task: [{"sources": list(document.sources), "tokens": int(document.input_ids.shape[1])}
                                 for document in task_documents] for task, task_documents in documents.items()},
            "seconds_per_document": seconds, "bootstrap": settings.bootstrap.record(),
            "prefix": settings.prefix, "chunk": settings.chunk, "segment": settings.segment}


def _joined(parts: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    return {key: np.concatenate([part[key] for part in parts]) for key in parts[0]}


def _rows(cells: dict[tuple[str, str, str], list[StreamTrace]], settings: StreamSettings,
          units: dict[str, list[str]]) -> list[dict]:
    """One results row per cell; ``units``: task -> per document, the bootstrap's unit (its segments are drawn with
    every other document's of that unit)."""
    ratios = {memory.label: memory.ratio for memory in settings.memory}
    rows = []
    for (method, label, task), traces in cells.items():
        full_traces = cells.get((FULL, FULL, task))
        if full_traces is None:
            continue
        parts = [segment_sums(trace, settings.segment) for trace in traces]
        sums, full = _joined(parts), _joined([segment_sums(trace, settings.segment) for trace in full_traces])
        numbers = [number for number, part in enumerate(parts) for _ in part["tokens"]]
        groups = [units[task][number] for number in numbers]
        tags = [{"document": str(number)} for number in numbers]
        row = result_row(method, ratios.get(label, 0.0 if method == FULL else None), task, "ppl", MAIN_METRIC,
                         sums, full, tags, settings.bootstrap, groups)
        row["setting"] = label
        metrics, intervals = row["metrics"], row["intervals"]
        metrics.pop("kl", None)
        intervals.pop("kl", None)
        metrics["nll"] = float(sums["nll"].sum() / sums["tokens"].sum())
        weights = settings.bootstrap.weights(len(sums["tokens"]), task, groups)
        intervals["nll"] = list(settings.bootstrap.interval((weights @ sums["nll"]) / (weights @ sums["tokens"])))
        metrics["kv_bytes_end"] = float(np.mean([trace.steps[-1][1] for trace in traces]))
        metrics["kept_tokens_end"] = float(np.mean([trace.steps[-1][2] for trace in traces]))
        metrics["kv_bytes_pct"] = 100.0 * metrics["kv_bytes"] / float(np.mean(full["kv_bytes"]))
        metrics["kv_bytes_end_pct"] = 100.0 * metrics["kv_bytes_end"] / np.mean([t.steps[-1][1] for t in full_traces])
        metrics["seconds_per_document"] = float(np.mean([trace.seconds for trace in traces]))
        rows.append(row)
    return rows


def summarize_streaming(rows: list[dict], bootstrap: Bootstrap, *, main: str | None) -> list[dict]:
    """Per task and setting: the main scorer's default cache against ``recency`` (equal bytes, the score
    alone differs) and against the best other non-curkv method, paired over the same segments, resampled
    by file (the rows' ``example_groups``)."""
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
                weights = bootstrap.weights(len(ours["tokens"]), task, mine.get("example_groups"))
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
