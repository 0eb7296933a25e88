"""``curkv-train eval``: compare a trained scorer with the known methods on held-out tasks.

The options are the typed signature of :func:`run_eval` (jsonargparse, in the root parser of
:mod:`curkv_train.cli`), so ``--help`` always matches it. Lists are comma-separated
(``--ratios 0.3,0.5,0.7``); booleans take a value (``--kvpress true``).
"""

from __future__ import annotations

import platform
import sys
from pathlib import Path
from typing import Literal

import torch
from jsonargparse.typing import register_type

from curkv_train.errors import CurKVError
from curkv_train.eval.harness import EvalSettings, evaluate
from curkv_train.eval.methods import BASELINES, CURKV, FULL, build_methods
from curkv_train.eval.report import write_run
from curkv_train.eval.tasks import SPAN_CUE, TASKS, DataRecipe, build_examples, check_tasks, load_streams
from curkv_train.models.base import load_base_model, load_tokenizer
from curkv_train.runtime.scorer import Scorer
from curkv_train.runtime.serialization import check_scorer_fits, load_scorer

DEFAULT_BASE = "embedded:smollm2-135m-instruct"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class FloatList(list):
    """Comma-separated numbers, e.g. ``0.3,0.5,0.7``."""


class IntList(list):
    """Comma-separated integers, e.g. ``512,1024``."""


class NameList(list):
    """Comma-separated names, e.g. ``ppl_text,passkey``."""


def _items(value) -> list:
    items = value if isinstance(value, (list, tuple)) else str(value).split(",")
    return [item.strip() if isinstance(item, str) else item for item in items if str(item).strip()]


register_type(FloatList, serializer=lambda v: ",".join(map(str, v)), deserializer=lambda v: FloatList(map(float, _items(v))))
register_type(IntList, serializer=lambda v: ",".join(map(str, v)), deserializer=lambda v: IntList(map(int, _items(v))))
register_type(NameList, serializer=lambda v: ",".join(v), deserializer=lambda v: NameList(map(str, _items(v))))


def run_eval(
    scorer: str,
    base: str | None = None,
    ratios: FloatList = FloatList([0.3, 0.5, 0.7]),
    tasks: NameList = NameList(TASKS),
    methods: NameList | None = None,
    out: str = "runs/eval",
    context_length: int = 1024,
    continuation_length: int = 128,
    examples: int = 12,
    seed: int = 0,
    n_sink: int | None = None,
    window: int | None = None,
    passkey_depths: FloatList = FloatList([0.1, 0.5, 0.9]),
    passkey_lengths: IntList | None = None,
    kvpress: bool = False,
    kvpress_budget: Literal["matched", "nominal"] = "matched",
    dtype: Literal["float32", "bfloat16", "float16"] = "float32",
    backend: Literal["auto", "torch", "triton"] = "auto",
    batch: int = 8,
) -> Path:
    """Evaluate KV-cache compression methods; write results.json, results.md, plots/ and tensorboard/.

    Args:
        scorer: exported scorer folder (checkpoints/NAME, or the name of a shipped checkpoint) or
            ``none`` for the baselines only.
        base: base model (hub id, folder, ``embedded:NAME``, ``tiny-random-llama``); default: the
            scorer's base, or embedded SmolLM2-135M-Instruct without a scorer.
        ratios: compression ratios, comma-separated (0.7 drops 70 % of the compressible tokens).
        tasks: comma-separated subset of ppl_text, ppl_code, passkey, repeated_span.
        methods: comma-separated subset of full, random, streaming_llm, h2o, snapkv, tova, knorm,
            curdkv, expected_attention, curkv; default all (curkv only with a scorer).
        out: run directory.
        context_length: context tokens per example (compressed).
        continuation_length: continuation tokens per example (scored).
        examples: examples per task.
        seed: seed of the held-out examples and of the random method.
        n_sink: always-kept leading tokens; default the scorer's (else 4).
        window: always-kept recent tokens; default the scorer's (else 64).
        passkey_depths: passkey needle depths, comma-separated, in [0, 1].
        passkey_lengths: passkey context lengths; default context_length / 2 and context_length.
        kvpress: also run kvpress's own presses as ``kvpress:<name>`` rows (cross-check).
        kvpress_budget: ``matched`` (presses keep as many tokens as our path) or ``nominal``.
        dtype: base model dtype (float32, bfloat16, float16).
        backend: compaction kernel backend (auto, torch, triton).
        batch: continuations of equal cache length run together, at most this many per forward
            (memory: batch × continuation_length × vocabulary float32 logits).
    """
    if dtype not in DTYPES:
        raise CurKVError(f"unknown dtype {dtype!r}; expected one of {', '.join(DTYPES)}")
    task_names = check_tasks(list(tasks))
    trained = None if scorer.lower() == "none" else load_scorer(scorer)
    fallback = None if base else _scorer_fallback(trained)
    base = base or _scorer_base(trained) or (DEFAULT_BASE if trained is None else None)
    if base is None:
        raise CurKVError(f"scorer {scorer!r} does not record its base model; pass --base")
    n_sink = n_sink if n_sink is not None else (trained.n_sink if trained else 4)
    window = window if window is not None else (trained.window if trained else 64)
    method_names = list(methods) if methods else [FULL, *BASELINES, *([CURKV] if trained else [])]
    score_functions = build_methods(method_names, trained, n_sink=n_sink, window=window)
    settings = EvalSettings(list(ratios), n_sink=n_sink, window=window, seed=seed, backend=backend,
                            kvpress=kvpress, kvpress_budget=kvpress_budget, max_batch=batch)
    lengths = list(passkey_lengths) if passkey_lengths else _default_passkey_lengths(context_length, settings)
    _check_shapes(settings, context_length, continuation_length, examples, lengths, list(passkey_depths), task_names)

    model = load_base_model(base, fallback=fallback, dtype=DTYPES[dtype])
    tokenizer = load_tokenizer(base, fallback=fallback)
    if trained is not None:
        check_scorer_fits(trained, model)
    recipe = DataRecipe.of_scorer(trained.metadata if trained is not None else None)
    streams = load_streams(tokenizer, task_names, recipe)
    task_examples = {task: build_examples(task, tokenizer, streams, context_length=context_length,
                                          continuation_length=continuation_length, examples=examples, seed=seed,
                                          protected=(n_sink, window), passkey_depths=list(passkey_depths),
                                          passkey_lengths=lengths)
                     for task in task_names}
    results = evaluate(model, task_examples, score_functions, settings,
                       progress=lambda line: print(f"curkv-train eval: {line}", file=sys.stderr, flush=True),
                       tokenizer=tokenizer)
    config = {"scorer": scorer, "base": base, "ratios": list(ratios), "tasks": task_names,
              "methods": list(score_functions), "context_length": context_length,
              "continuation_length": continuation_length, "examples": examples, "seed": seed, "n_sink": n_sink,
              "window": window, "passkey_depths": list(passkey_depths), "passkey_lengths": lengths,
              "kvpress": kvpress, "kvpress_budget": kvpress_budget, "dtype": dtype, "backend": backend, "batch": batch,
              "torch": torch.__version__, "python": platform.python_version(),
              "data": {"recipe": recipe.origin, "sources": recipe.record(),
                       "streams": {name: stream.record() for name, stream in streams.items()}}}
    return write_run(out, results, config)


def _default_passkey_lengths(context_length: int, settings: EvalSettings) -> list[int]:
    half = context_length // 2
    return [half, context_length] if half > settings.n_sink + settings.window else [context_length]


def _check_shapes(settings: EvalSettings, context_length: int, continuation_length: int, examples: int,
                  passkey_lengths: list[int], passkey_depths: list[float], tasks: list[str]) -> None:
    """One-line errors for option values no example could be built from."""
    if examples < 1:
        raise CurKVError(f"--examples must be at least 1, got {examples}")
    if continuation_length < 2:
        raise CurKVError(f"--continuation-length must be at least 2 (one scored prediction), got "
                         f"{continuation_length}")
    if "repeated_span" in tasks and continuation_length < SPAN_CUE + 2:
        raise CurKVError(f"repeated_span needs --continuation-length >= {SPAN_CUE + 2} (an {SPAN_CUE}-token cue "
                         f"plus the copy), got {continuation_length}")
    settings.check_context(context_length)
    if "passkey" in tasks:
        for length in passkey_lengths:
            settings.check_context(length, "passkey context")
        if not passkey_depths or any(not 0.0 <= depth <= 1.0 for depth in passkey_depths):
            raise CurKVError(f"--passkey-depths must lie in [0, 1], got {passkey_depths}")


def _scorer_base(scorer: Scorer | None) -> str | None:
    """The base model id a scorer records (``base_model`` may be an id or ``{"id": ..., "fingerprint": ...}``)."""
    if scorer is None:
        return None
    base = scorer.metadata.get("base_model")
    return (base.get("id") if isinstance(base, dict) else base) or None


def _scorer_fallback(scorer: Scorer | None) -> str | None:
    """The fallback base the scorer was trained with (its run's ``model.base_fallback``), if any."""
    if scorer is None:
        return None
    hyper_parameters = scorer.metadata.get("training", {}).get("hyper_parameters", {})
    return hyper_parameters.get("base_fallback")


def main(**options) -> Path:
    """``curkv-train eval``: run :func:`run_eval` with the parsed ``options``, print where the results are."""
    run_dir = run_eval(**options)
    print(f"results: {run_dir / 'results.md'}")
    return run_dir
