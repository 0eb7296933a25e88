"""``curkv-train eval``: compare a trained scorer with the known methods on held-out tasks.

The options are the fields of :class:`EvalConfig` (jsonargparse, in the root parser of
:mod:`curkv_train.cli`), so ``--help`` always matches it. Lists are comma-separated
(``--ratios 0.3,0.5,0.7``); booleans take a value (``--kvpress true``).
"""

from __future__ import annotations

import platform
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Literal

import torch

from curkv_train.core.errors import CurKVError
from curkv_train.core.selection import check_budget_prior
from curkv_train.core.shapes import text_config
from curkv_train.eval.allocated import ALLOCATED_RULES, RAGGED, SAME, AllocatedRows, one_prefill
from curkv_train.eval.harness import EvalSettings, evaluate
from curkv_train.eval.kvpress_bridge import baseline_method
from curkv_train.eval.rule_budget import OWN, load_rule_budgets
from curkv_train.eval.heldout import STREAM_TASKS, load_stream_documents, training_hashes
from curkv_train.eval.lists import FloatList, IntList, NameList
from curkv_train.eval.methods import BASELINES, CURKV, CURKV_CACHE, CURKV_UNIFORM, FULL, SCORER_METHODS
from curkv_train.eval.methods import build_methods, check_methods
from curkv_train.eval.report import write_run
from curkv_train.eval.scorer_entries import ScorerEntry, build_scorers, fresh_scorer, load_trained, parse_scorers
from curkv_train.eval.stream_rows import StreamSettings, check_memory, memory_settings, select_rows, stream_methods
from curkv_train.eval.streaming import evaluate_streaming
from curkv_train.eval.tasks import SPAN_CUE, TASKS, DataRecipe, build_examples, check_tasks, load_streams
from curkv_train.models.base import load_base_model, load_tokenizer
from curkv_train.runtime.allocation import LayerBudget
from curkv_train.runtime.scorer import Scorer
from curkv_train.runtime.serialization import check_scorer_fits

ALL_TASKS = (*TASKS, *STREAM_TASKS)

DEFAULT_BASE = "embedded:smollm2-135m-instruct"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class EvalConfig:
    """Evaluate KV-cache compression methods; write results.json, results.md and plots/.

    Args:
        scorer: exported scorer folder (checkpoints/NAME, or a shipped checkpoint's name), ``none`` for the
            baselines only, or comma-separated ``LABEL=SOURCE`` entries (rows ``curkv:LABEL``; one may stay bare:
            rows ``curkv``), SOURCE a folder or ``init:FAMILY`` (an untrained estimator, seed 0). The first entry
            is the main scorer: the summary is about it; its base, recipe and spans are the run's defaults.
        base: base model (hub id, folder, ``embedded:NAME``, ``tiny-random-llama``); default: the scorer's base,
            or embedded SmolLM2-135M-Instruct without a scorer.
        ratios: compression ratios, comma-separated (0.7 drops 70 % of the compressible tokens).
        tasks: comma-separated subset of ppl_text, ppl_code, passkey, repeated_span (prefill tasks) and
            stream_text, stream_code (streaming: long documents fed through each cache in chunks).
        methods: prefill tasks: comma-separated subset of full, random, streaming_llm, h2o, snapkv, tova, knorm,
            curdkv, expected_attention, curkv, curkv_cache (the scorer through the runtime CurKVCache); default all
            (curkv, curkv_cache with a scorer). A scorer with a calibrated layer budget keeps ρ per layer in its
            curkv rows and gets a curkv_uniform row (one ratio for every layer).
        out: run directory.
        context_length: context tokens per example (compressed).
        continuation_length: continuation tokens per example (scored).
        examples: examples per task.
        seed: seed of the held-out examples and of the presses that sample.
        n_sink: always-kept leading tokens of every row (the presses' selections, the runtime caches' sinks);
            default the main scorer's, else 4.
        window: always-kept recent tokens of every row (the runtime caches' window: their hot tier is
            ``hot_windows`` of them); default the main scorer's, else 64.
        passkey_depths: passkey needle depths, comma-separated, in [0, 1].
        passkey_lengths: passkey context lengths; default context_length / 2 and context_length.
        kvpress: prefill tasks: also run kvpress's presses as kvpress ships them (their own protected tokens),
            rows ``kvpress:<name>``.
        kvpress_budget: ``kvpress:<name>`` rows: ``matched`` (as many tokens as every other row) or ``nominal``.
        kvpress_presses: comma-separated subset of kvpress's presses (streaming_llm, snapkv, tova, knorm,
            expected_attention, observed_attention, cur, leverage, random, compactor, criticalkv, keydiff, lagkv,
            pyramidkv: its own split across layers, adakv: ExpectedAttention's scores, the places shared by a layer's
            heads, evicted keys masked in a whole cache, kvzip: only when named, every layer and head sharing the
            places by context reconstruction, masked); default every one the installed kvpress provides but kvzip.
        dtype: base model dtype. In half precision the reference and the rows run different kernels (one forward
            vs batches or chunks) and round differently: ratio 0.0 shows that floor.
        backend: kernel backend of the runtime caches (curkv_cache and the streaming rows).
        batch: continuations of equal cache length run together, at most this many per forward (memory: batch ×
            continuation_length × vocabulary float32 logits).
        stream_length: tokens per streamed document (prefix included).
        stream_prefix: tokens prefilled at once; the streaming perplexity is over the tokens after them.
        stream_chunk: tokens fed per step after the prefix (1 = token by token).
        stream_documents: documents per streaming task, at most.
        stream_segment: scored tokens per recorded segment (the bootstrap resamples held-out files).
        stream_rows: comma-separated subset of the streaming rows (full, streaming_llm, curkv, curkv_uniform,
            curkv_score_only, curkv_cold, curkv_compensated, recency, curkv:LABEL); default all; ``full`` always runs.
        budget_tokens: streaming task: also run every compressing row under these budgets of tokens per (layer,
            KV head), comma-separated (the runtime cache's max_tokens).
        budget_bytes: streaming task: budgets in bytes for the whole cache (max_bytes).
        budget_baselines: prefill tasks: the baselines' presses follow the main scorer's calibrated layer budget
            too (the allocation without the learned scores; ``kvpress:<name>`` rows keep one ratio).
        same_allocation: prefill tasks: the rules (kvpress's snapkv, expected_attention, tova, knorm, cur, compactor,
            keydiff, lagkv, and h2o) run at the main scorer's own allocation, rows ``same:<rule>``: every (layer, KV
            head) holds what it holds in the ``curkv_ragged`` row, the scorer through the runtime cache compressing
            the prefill once under its joint allocation (ragged heads); the summary then is about ``curkv_ragged``,
            and a second one sets it against these rows alone. Default: all of them for a scorer trained under the
            joint allocation, none for another; ``none``: none.
        budget_prior: prefill tasks, with the rows at the scorer's allocation: also the row ``curkv_ragged@prior``,
            the same cache with its calibrated layer budget weighed into the joint allocation at this weight
            (``TierConfig.budget_prior``, docs/runtime.md "The layer budget as a prior"); 0: no such row.
        rule_budgets: prefill tasks: ``RULE=FILE`` entries (``curkv-train calibrate --method RULE --out FILE``): the
            baseline RULE also runs at its own calibrated layer budget, row ``RULE@own``.
        scorer_precision: every scorer's query-feature products: ``highest`` (float32, as trained) or ``medium``
            (bfloat16 operands, faster on CPUs with bf16 instructions; docs/runtime.md).
    """

    scorer: str
    base: str | None = None
    ratios: FloatList = field(default_factory=lambda: FloatList([0.3, 0.5, 0.7]))
    tasks: NameList = field(default_factory=lambda: NameList(TASKS))
    methods: NameList | None = None
    out: str = "runs/eval"
    context_length: int = 1024
    continuation_length: int = 128
    examples: int = 12
    seed: int = 0
    n_sink: int | None = None
    window: int | None = None
    passkey_depths: FloatList = field(default_factory=lambda: FloatList([0.1, 0.5, 0.9]))
    passkey_lengths: IntList | None = None
    kvpress: bool = False
    kvpress_budget: Literal["matched", "nominal"] = "matched"
    kvpress_presses: NameList | None = None
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    backend: Literal["auto", "torch", "triton"] = "auto"
    batch: int = 8
    stream_length: int = 6144
    stream_prefix: int = 1024
    stream_chunk: int = 64
    stream_documents: int = 4
    stream_segment: int = 512
    stream_rows: NameList | None = None
    budget_tokens: IntList | None = None
    budget_bytes: IntList | None = None
    budget_baselines: bool = False
    same_allocation: NameList | None = None
    rule_budgets: str | None = None
    budget_prior: float = 0.0
    scorer_precision: Literal["highest", "medium"] = "highest"


def run_eval(config: EvalConfig) -> Path:
    """Run the evaluation ``config`` describes; returns the run folder (results.json, results.md, plots/)."""
    tasks = check_tasks(list(config.tasks), valid=ALL_TASKS)
    prefill_tasks, streaming_tasks = [task for task in tasks if task in TASKS], [t for t in tasks if t in STREAM_TASKS]
    entries = parse_scorers(config.scorer)
    rule_budgets = load_rule_budgets(config.rule_budgets)  # a bad file fails before the model loads
    main = entries[0] if entries else None
    trained = load_trained(entries)
    base, fallback = _resolve_base(config.scorer, config.base, trained, main)
    settings = _settings(config, trained.get(main.method) if main else None)
    names = list(config.methods) if config.methods else [FULL, *BASELINES, *(SCORER_METHODS if entries else [])]
    names = check_methods(names, bool(entries))
    half = config.context_length // 2
    lengths = list(config.passkey_lengths or ([half] if half > settings.n_sink + settings.window else []) + [
        config.context_length])
    if prefill_tasks:
        _check_shapes(settings, config, lengths, prefill_tasks)
    stream = _stream_settings(config) if streaming_tasks else None

    model = load_base_model(base, fallback=fallback, dtype=DTYPES[config.dtype])
    tokenizer = load_tokenizer(base, fallback=fallback)
    spans = (settings.n_sink, settings.window)  # every row protects the same
    scorers = build_scorers(entries, trained, model, base, spans=spans, matmul_precision=config.scorer_precision)
    for loaded in scorers.values():
        check_scorer_fits(loaded, model)
    budget = scorers[main.method].layer_budget if main and config.budget_baselines else None
    if config.budget_baselines and budget is None:
        raise CurKVError("--budget_baselines needs a main scorer with a calibrated layer budget (curkv-train "
                         "calibrate --scorer DIR)")
    rows = _stream_rows(model, scorers, main, base, stream, config, spans) if stream else []
    recipe = DataRecipe.of_scorers([loaded.metadata for loaded in trained.values()])
    training = training_hashes(tokenizer, list(recipe.sources))
    progress = lambda line: print(f"curkv-train eval: {line}", file=sys.stderr, flush=True)
    streams = load_streams(tokenizer, prefill_tasks, recipe, training) if prefill_tasks else {}
    task_examples = {task: build_examples(task, tokenizer, streams, context_length=config.context_length,
                                          continuation_length=config.continuation_length, examples=config.examples,
                                          seed=config.seed, protected=spans, passkey_depths=list(config.passkey_depths),
                                          passkey_lengths=lengths)
                     for task in prefill_tasks}
    presses, cache_methods, ours, not_baselines = _prefill_methods(names, entries, scorers, main, spans, budget)
    presses.update({rule + OWN: baseline_method(rule, n_sink=spans[0], window=spans[1], layer_budget=budget)
                    for rule, budget in rule_budgets.items()})
    allocated = _allocated_rows(config, scorers[main.method] if main else None, spans)
    if allocated is not None:
        ours, not_baselines = RAGGED, (*not_baselines, main.method, *allocated.own_rows()[1:])
    results = evaluate(model, task_examples, presses, settings, progress=progress, cache_methods=cache_methods,
                       ours=ours, not_baselines=not_baselines, allocated=allocated)
    if stream is not None:
        sources = {task: recipe.source(STREAM_TASKS[task])[0] for task in streaming_tasks}
        documents = load_stream_documents(tokenizer, streaming_tasks, sources, training[0],
                                          length=config.stream_length, count=config.stream_documents)
        results["streaming"] = evaluate_streaming(model, documents, rows, stream, progress=progress,
                                                  main=main.method if main else None)
        results["streaming"]["length"] = config.stream_length
    resolved = {"scorers": {entry.method: {"source": entry.source, "family": scorers[entry.method].family,
                                           "n_sink": settings.n_sink, "window": settings.window,
                                           "trained": entry.family is None} for entry in entries},
                "base": base, "tasks": tasks, "methods": [*presses, *cache_methods, *(
                    [*allocated.own_rows(), *(SAME + rule for rule in allocated.rules)] if allocated else [])],
                "n_sink": settings.n_sink,
                "window": settings.window, "passkey_lengths": lengths, "kvpress_presses": settings.kvpress_presses,
                "data": {"recipe": recipe.origin, "sources": recipe.record(),
                         "streams": {name: held.record() for name, held in streams.items()}}}
    return write_run(config.out, results, _run_record(config, resolved, stream is not None))


def _settings(config: EvalConfig, main: Scorer | None) -> EvalSettings:
    """The prefill tasks' settings; the spans default to the main scorer's (else 4 sinks, a window of 64)."""
    n_sink = config.n_sink if config.n_sink is not None else (main.n_sink if main else 4)
    window = config.window if config.window is not None else (main.window if main else 64)
    return EvalSettings(list(config.ratios), n_sink=n_sink, window=window, seed=config.seed, backend=config.backend,
                        kvpress=config.kvpress, kvpress_budget=config.kvpress_budget,
                        kvpress_presses=list(config.kvpress_presses) if config.kvpress_presses else None,
                        max_batch=config.batch)


def _allocated_rows(config: EvalConfig, main: Scorer | None, spans: tuple[int, int]) -> AllocatedRows | None:
    """The ``curkv_ragged`` and ``same:<rule>`` rows ``--same_allocation`` asks for (by default: every rule, for a
    main scorer trained under the joint allocation), or None."""
    names = list(config.same_allocation) if config.same_allocation is not None else (
        list(ALLOCATED_RULES) if main is not None and main.allocation == "joint" else [])
    if names == ["none"] or not names or not any(task in TASKS for task in config.tasks):
        if config.budget_prior:
            raise CurKVError("--budget_prior adds a row beside the rules at the scorer's allocation: pass a joint "
                             "scorer, a prefill task and --same_allocation")
        return None
    if main is None:
        raise CurKVError("--same_allocation runs rules at a scorer's allocation: pass --scorer")
    unknown = [name for name in names if name not in ALLOCATED_RULES]
    if unknown:
        raise CurKVError(f"unknown rule(s) {', '.join(map(repr, unknown))} for --same_allocation; expected "
                         f"{', '.join(ALLOCATED_RULES)} or none")
    tiers = one_prefill(*spans, config.continuation_length)
    return AllocatedRows(main, tuple(names), tiers, config.backend, check_budget_prior(config.budget_prior))


def _resolve_base(scorer: str, base: str | None, trained: dict, main: ScorerEntry | None) -> tuple[str, object]:
    """The base model to load (given, else the main scorer's, else the default without a trained scorer) and the
    fallback source for its weights; CurKVError when a trained scorer records none and none is given."""
    reference = (trained.get(main.method) if main else None) or next(iter(trained.values()), None)
    fallback = None if base or reference is None else reference.base_fallback
    base = base or (reference.base_model_id if reference else None) or (DEFAULT_BASE if not trained else None)
    if base is None:
        raise CurKVError(f"scorer {scorer!r} does not record its base model; pass --base")
    return base, fallback


def _stream_settings(config: EvalConfig) -> StreamSettings:
    """The streaming task's settings from ``config``, checked (one-line errors)."""
    stream = StreamSettings(memory_settings(list(config.ratios), config.budget_tokens, config.budget_bytes),
                            prefix=config.stream_prefix, chunk=config.stream_chunk, segment=config.stream_segment,
                            backend=config.backend, seed=config.seed)
    stream.check_length(config.stream_length, None)
    if config.stream_documents < 1:
        raise CurKVError(f"--stream_documents must be at least 1, got {config.stream_documents}")
    return stream


def _stream_rows(model, scorers: dict[str, Scorer], main: ScorerEntry | None, base: str, stream: StreamSettings,
                 config: EvalConfig, spans: tuple[int, int]) -> list:
    """The streaming task's rows (``--stream_rows`` of them), after checking the length against the model and the
    memory the rows would take; ``spans``: the run's (n_sink, window)."""
    carrier = scorers[main.method] if main else replace(fresh_scorer("seed", model, base), n_sink=spans[0],
                                                        window=spans[1])
    stream.check_length(config.stream_length, getattr(text_config(model.config), "max_position_embeddings", None))
    check_memory(model, scorers, carrier, stream)
    rows = stream_methods(model, scorers, carrier, stream, main=main.method if main else None)
    return select_rows(rows, list(config.stream_rows) if config.stream_rows else None)


def _prefill_methods(method_names: list[str], entries: list[ScorerEntry], scorers: dict[str, Scorer],
                     main: ScorerEntry | None, spans: tuple[int, int],
                     baseline_budget: LayerBudget | None) -> tuple[dict, dict, str, tuple[str, ...]]:
    """The prefill tasks' presses, runtime-cache rows (``curkv_cache``), the row the verdicts are about and the
    rows that are not baselines of it."""
    presses = build_methods([name for name in method_names if name != CURKV_CACHE], scorers, n_sink=spans[0],
                            window=spans[1], baseline_budget=baseline_budget)
    cache_methods = ({entry.suffixed(CURKV_CACHE): scorers[entry.method] for entry in entries}
                     if CURKV_CACHE in method_names else {})
    ours = main.method if main else CURKV
    uniform_rows = [name for name in presses if name.startswith(CURKV_UNIFORM)]
    not_baselines = tuple(name for name in [*scorers, *cache_methods, *uniform_rows] if name != ours)
    return presses, cache_methods, ours, not_baselines


def _run_record(config: EvalConfig, resolved: dict, streaming: bool) -> dict:
    """results.json's ``config``: the options as given (the streaming task's under ``stream``), what was resolved
    from them, and the software versions."""
    options = {key: list(value) if isinstance(value, list) else value for key, value in asdict(config).items()}
    stream = {key[len("stream_"):]: options.pop(key) for key in list(options) if key.startswith("stream_")}
    stream.update(budget_tokens=options.pop("budget_tokens") or [], budget_bytes=options.pop("budget_bytes") or [])
    return {**options, **resolved, "stream": stream if streaming else None, "torch": torch.__version__,
            "python": platform.python_version()}


def _check_shapes(settings: EvalSettings, config: EvalConfig, passkey_lengths: list[int], tasks: list[str]) -> None:
    """One-line errors for option values no example could be built from."""
    if config.examples < 1:
        raise CurKVError(f"--examples must be at least 1, got {config.examples}")
    if config.continuation_length < 2:
        raise CurKVError(f"--continuation_length must be at least 2 (one scored prediction), got "
                         f"{config.continuation_length}")
    if "repeated_span" in tasks and config.continuation_length < SPAN_CUE + 2:
        raise CurKVError(f"repeated_span needs --continuation_length >= {SPAN_CUE + 2} (an {SPAN_CUE}-token cue "
                         f"plus the copy), got {config.continuation_length}")
    settings.check_context(config.context_length)
    if "passkey" in tasks:
        for length in passkey_lengths:
            settings.check_context(length, "passkey context")
        if not config.passkey_depths or any(not 0.0 <= depth <= 1.0 for depth in config.passkey_depths):
            raise CurKVError(f"--passkey_depths must lie in [0, 1], got {list(config.passkey_depths)}")


def main(**options) -> Path:
    """``curkv-train eval``: run :func:`run_eval` on the parsed ``options`` (:class:`EvalConfig`'s fields), print
    where the results are."""
    run_dir = run_eval(EvalConfig(**options))
    print(f"results: {run_dir / 'results.md'}")
    return run_dir
