"""The evaluation loop: every (method, ratio) of every example through the same path.

Per example the full cache's continuation is the reference; for each ratio every compressing row prefills
the context under its kvpress press (:mod:`curkv_train.eval.methods`) and continues from the cache it left
(equal lengths batched). ``curkv_cache`` rows feed the context, then the continuation a window at a time,
through the runtime CurKVCache at its defaults, which compresses as during generation.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache, PreTrainedModel

from curkv_train.core.errors import CurKVError
from curkv_train.eval import kvpress_bridge
from curkv_train.eval.allocated import RAGGED, SAME, AllocatedRows
from curkv_train.eval.clock import clock
from curkv_train.eval.compressed import batched_continuation_logits, continuation_logits
from curkv_train.eval.kvpress_bridge import PressMethod
from curkv_train.eval.methods import CURKV, FULL
from curkv_train.eval.metrics import ExampleSums, continuation_sums
from curkv_train.eval.runtime_caches import cache_budget, continue_in_windows, prefill_budget
from curkv_train.eval.statistics import Bootstrap, result_rows, summarize
from curkv_train.eval.tasks import MAIN_METRIC, TASKS, TaskExample
from curkv_train.runtime.attention import install_runtime_attention
from curkv_train.runtime.cache import CurKVCache
from curkv_train.runtime.cache_config import ComputeConfig
from curkv_train.runtime.scorer import Scorer


@dataclass
class EvalSettings:
    """How every method is run: the :class:`~curkv_train.eval.cli.EvalConfig` options of the same names (``max_batch``:
    ``--batch``) and the bootstrap (``resamples``, seeded by ``seed``) behind every interval and verdict."""

    ratios: list[float]
    n_sink: int = 4
    window: int = 64
    seed: int = 0
    backend: str = "auto"
    kvpress: bool = False
    kvpress_budget: str = "matched"
    kvpress_presses: list[str] | None = None
    max_batch: int = 8
    resamples: int = 2000
    bootstrap: Bootstrap = field(init=False, repr=False)

    def __post_init__(self) -> None:
        bad = [ratio for ratio in self.ratios if not 0.0 <= ratio < 1.0]
        if bad or not self.ratios:
            raise CurKVError(f"compression ratios must lie in [0, 1) (0.7 drops 70 % of the compressible "
                             f"tokens), got {self.ratios}")
        if len(set(self.ratios)) != len(self.ratios):
            raise CurKVError(f"compression ratios repeat ({self.ratios}); give each ratio once")
        if self.max_batch < 1:
            raise CurKVError(f"the continuation batch must be at least 1, got {self.max_batch}")
        self.bootstrap = Bootstrap(resamples=self.resamples, seed=self.seed)  # 95 %, every interval and verdict
        if self.kvpress:
            self.kvpress_presses = kvpress_bridge.select_presses(self.kvpress_presses)

    def check_context(self, context_length: int, what: str = "context") -> None:
        """A CurKVError unless ``context_length`` leaves compressible tokens after sinks and window."""
        if context_length <= self.n_sink + self.window:
            raise CurKVError(f"{what} length {context_length} must exceed n_sink + window "
                             f"({self.n_sink} + {self.window}); nothing would be compressed at any ratio. "
                             "Raise --context_length or lower --window / --n_sink")


@dataclass
class _Entry:
    """One compressed cache of an example at one ratio: its budget, and its sums once continued."""

    name: str
    cache: DynamicCache | None
    budget: dict[str, float]
    sums: dict[str, float] = field(default_factory=dict)


@torch.no_grad()
def evaluate_example(model: PreTrainedModel, example: TaskExample, methods: dict[str, PressMethod | None],
                     settings: EvalSettings, seed: int,
                     cache_methods: dict[str, Scorer] | None = None,
                     allocated: AllocatedRows | None = None) -> list[tuple[str, float, dict[str, float]]]:
    """(method, ratio, sums) for every method and ratio on one example; the full cache (row ``full`` at ratio 0) is
    the reference of every KL and perplexity increase. ``cache_methods`` (method name -> scorer) run through the
    runtime CurKVCache at its defaults; ``allocated``: the scorer's one-prefill ragged row and the rules at its
    allocation (:mod:`curkv_train.eval.allocated`)."""
    ids = example.input_ids.to(next(model.parameters()).device)
    length = example.context_length
    context_ids, continuation_ids = ids[:, :length], ids[:, length:]
    full_cache = DynamicCache(config=model.config)
    started = clock()
    model.get_decoder()(input_ids=context_ids, past_key_values=full_cache, use_cache=True)
    full_budget = {**cache_budget(full_cache, length), "prefill_seconds": clock() - started}
    reference = continuation_logits(model, full_cache, continuation_ids, length)

    def measure(logits: torch.Tensor) -> dict[str, float]:
        return continuation_sums(logits, reference, continuation_ids, example.answer)

    rows = [(FULL, 0.0, {**measure(reference), **full_budget})]
    rules = allocated.scores(model, context_ids, seed) if allocated is not None else {}
    for ratio in settings.ratios:
        entries = []
        for name, method in methods.items():
            if method is not None:
                press = method.press(length, ratio, seed, n_sink=settings.n_sink, window=settings.window,
                                     budget=settings.kvpress_budget)
                cache, seconds = kvpress_bridge.press_cache(model, method.spec, press, context_ids, seed)
                entry = _Entry(name, cache, {**cache_budget(cache, length), "prefill_seconds": seconds})
                if method.spec.masked:  # its masks live on the model until the next prefill: continue now
                    entry.budget["kept_tokens"] = kvpress_bridge.masked_kept(model, cache)
                    entry.sums, entry.cache = measure(kvpress_bridge.masked_continuation(model, cache,
                                                                                         continuation_ids)), None
                entries.append(entry)
        for name, scorer in (cache_methods or {}).items():
            cache = CurKVCache(scorer, model=model, keep_ratio=1.0 - ratio, compute=ComputeConfig(backend=settings.backend))
            budget = prefill_budget(model, cache, context_ids)
            entries.append(_Entry(name, None, budget, measure(continue_in_windows(model, cache, continuation_ids))))
        if allocated is not None:
            entries += [_Entry(name, None, budget, measure(logits)) for name, logits, budget in
                        allocated.rows(model, context_ids, continuation_ids, 1.0 - ratio, rules)]
        pending = [entry for entry in entries if entry.cache is not None]
        all_logits = batched_continuation_logits(model, [entry.cache for entry in pending], continuation_ids, length,
                                                 settings.max_batch)
        for entry, logits in zip(pending, all_logits):
            entry.sums = measure(logits)
        rows += [(entry.name, ratio, {**entry.sums, **entry.budget}) for entry in entries]
    return rows


def evaluate(model: PreTrainedModel, examples: dict[str, list[TaskExample]],
             methods: dict[str, PressMethod | None], settings: EvalSettings,
             progress: Callable[[str], None] | None = None,
             cache_methods: dict[str, Scorer] | None = None, ours: str = CURKV,
             not_baselines: tuple[str, ...] = (), allocated: AllocatedRows | None = None) -> dict:
    """Run every method on every example; the rows, the verdicts and what they were computed from.

    Args:
        methods: method name -> its press (``full`` -> None, :func:`~curkv_train.eval.methods.build_methods`);
            with ``settings.kvpress`` the ``kvpress:<name>`` rows are added.
        progress: called with one line per finished example.
        cache_methods: method name -> trained scorer run through the runtime CurKVCache (``curkv_cache``).
        allocated: the ``curkv_ragged`` row and the ``same:<rule>`` rows at its allocation.
        ours: the method the summary's verdict is about; ``not_baselines``: other rows that are not baselines.

    Returns:
        {"rows" (:func:`~curkv_train.eval.statistics.result_rows`), "summary" (``ours`` against the best baseline,
        :func:`~curkv_train.eval.statistics.summarize`), "main_metric", "seconds_per_example", "bootstrap",
        "documents": per perplexity task the held-out documents of each example}.
    """
    for task, task_examples in examples.items():
        for example in task_examples:
            settings.check_context(example.context_length, f"{task} context")
    if settings.kvpress:
        methods = {**methods, **{kvpress_bridge.PREFIX + name: kvpress_bridge.kvpress_method(
            name, n_sink=settings.n_sink, window=settings.window) for name in settings.kvpress_presses}}
    budgeted = any(method is not None and (method.layer_budget is not None or method.spec.layered)
                   for method in methods.values())
    # layers of a budgeted cache hold different counts: the wrapper fits the mask, for this evaluation only
    log, seconds, number = ExampleSums(), {}, 0
    with install_runtime_attention(model, factored=False, per_layer=True) if budgeted else nullcontext():
        for task, task_examples in examples.items():
            started = time.perf_counter()
            for index, example in enumerate(task_examples):
                tick = time.perf_counter()
                for method, ratio, sums in evaluate_example(model, example, methods, settings,
                                                            settings.seed * 1_000_003 + number, cache_methods,
                                                            allocated):
                    log.add(method, ratio, task, sums)
                number += 1
                if progress is not None:
                    progress(f"{task} {index + 1}/{len(task_examples)}: {time.perf_counter() - tick:.1f} s")
            seconds[task] = (time.perf_counter() - started) / max(1, len(task_examples))
    main_metric = {task: MAIN_METRIC[TASKS[task][0]] for task in examples}
    kinds = {task: TASKS[task][0] for task in examples}
    tags = {task: [example.tags for example in task_examples] for task, task_examples in examples.items()}
    # perplexity examples resampled by document (TaskExample.group); synthetic ones one by one
    groups = {task: [example.group for example in task_examples]
              if all(example.group for example in task_examples) else None
              for task, task_examples in examples.items()}
    rows = result_rows(log, tags, main_metric, kinds, settings.bootstrap, FULL, groups)
    borrowed = {row["method"] for row in rows if row["method"].startswith(SAME)}  # the scorer's allocation: no system
    summary = summarize(rows, main_metric, kinds, settings.bootstrap, ours=ours, reference=FULL,
                        exclude=set(not_baselines) | borrowed)
    same = [] if allocated is None else summarize(
        rows, main_metric, kinds, settings.bootstrap, ours=RAGGED, reference=FULL,
        exclude={row["method"] for row in rows} - borrowed)
    return {"rows": rows, "summary": summary, "summary_same_allocation": same, "main_metric": main_metric, "seconds_per_example": seconds,
            "bootstrap": settings.bootstrap.record(),
            "documents": {task: [list(example.documents) for example in task_examples]
                          for task, task_examples in examples.items()
                          if any(example.documents for example in task_examples)}}
