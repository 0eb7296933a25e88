"""Evaluation tasks on held-out data: perplexity on text and code, passkey retrieval, repeated spans.

Documents come from the validation split of the data module's sources (the split is
a stable hash of the document id, so none of them reached training); synthetic
examples are drawn from string-seeded generators, a stream of seeds that training
(integer seeds) never uses.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np
import torch

from curkv_train.data.synthetic import passkey, repeated_span
from curkv_train.errors import CurKVError

# task -> (metric kind for curkv_train.eval.metrics.finalize, token stream it reads)
TASKS = {
    "ppl_text": ("ppl", "text"),
    "ppl_code": ("ppl", "code"),
    "passkey": ("passkey", "text"),
    "repeated_span": ("span", "text"),
}
# stream -> (document source kind, val_fraction) of the data module's sources
STREAMS = {"text": ("pydoc", 0.3), "code": ("stdlib", 0.1)}
# The main metric of each task kind (plots and tables list every metric; this one leads).
MAIN_METRIC = {"ppl": "ppl_increase_pct", "passkey": "accuracy", "span": "token_accuracy"}
SPAN_CUE = 8


@dataclass
class TaskExample:
    """One held-out example.

    Attributes:
        task: task name (a key of :data:`TASKS`).
        input_ids: (1, context + continuation) token ids.
        context_length: tokens of the compressed context.
        answer: [start, end) answer span in continuation coordinates, or None (whole continuation).
        tags: breakdown labels, e.g. {"depth": "0.5", "length": "1024"}.
    """

    task: str
    input_ids: torch.Tensor
    context_length: int
    answer: tuple[int, int] | None = None
    tags: dict[str, str] = field(default_factory=dict)


def check_tasks(names: list[str]) -> list[str]:
    """``names`` without duplicates, or a CurKVError listing the valid task names."""
    unknown = [name for name in names if name not in TASKS]
    if unknown:
        raise CurKVError(f"unknown task(s) {', '.join(map(repr, unknown))}; valid tasks: {', '.join(TASKS)}")
    if not names:
        raise CurKVError(f"no task selected; valid tasks: {', '.join(TASKS)}")
    return list(dict.fromkeys(names))


def load_streams(tokenizer, tasks: list[str]) -> dict[str, np.ndarray]:
    """Validation token streams the ``tasks`` read (pydoc prose at val_fraction 0.3, stdlib code at 0.1)."""
    from curkv_train.data.tokenized import token_stream

    needed = {TASKS[task][1] for task in tasks}
    return {name: token_stream(tokenizer, STREAMS[name][0], "val", val_fraction=STREAMS[name][1])
            for name in sorted(needed)}


def _rng(seed: int, task: str, index: int) -> random.Random:
    return random.Random(f"curkv-eval/{seed}/{task}/{index}")


def _document_block(stream: np.ndarray, length: int, rng: random.Random) -> torch.Tensor:
    if len(stream) < length:
        raise CurKVError(f"the held-out stream has {len(stream)} tokens, fewer than one example of {length}; "
                         "lower --context-length / --continuation-length")
    start = rng.randrange(0, len(stream) - length + 1)
    return torch.from_numpy(stream[start : start + length].copy())


def build_examples(task: str, tokenizer, streams: dict[str, np.ndarray], *, context_length: int,
                   continuation_length: int, examples: int, seed: int, protected: tuple[int, int],
                   passkey_depths: list[float], passkey_lengths: list[int]) -> list[TaskExample]:
    """``examples`` examples of ``task``; passkey examples cycle over the (length, depth) grid.

    Args:
        streams: token streams by name (see :func:`load_streams`).
        protected: (n_sink, window), spans the synthetic answers are placed outside of.
    """
    kind, stream_name = TASKS[task]
    stream = streams[stream_name]
    filler = stream.tolist() if kind != "ppl" else None
    built = []
    for index in range(examples):
        rng = _rng(seed, task, index)
        if kind == "ppl":
            ids = _document_block(stream, context_length + continuation_length, rng)
            built.append(TaskExample(task, ids[None], context_length))
        elif kind == "passkey":
            grid = [(length, depth) for length in passkey_lengths for depth in passkey_depths]
            length, depth = grid[index % len(grid)]
            example = passkey(tokenizer, filler, length, continuation_length, rng, depth=depth, protected=protected)
            built.append(TaskExample(task, example.input_ids[None], length, (example.answer_start, example.answer_end),
                                     {"depth": f"{depth:g}", "length": str(length)}))
        else:
            example = repeated_span(tokenizer, filler, context_length, continuation_length, rng,
                                    protected=protected, cue_length=SPAN_CUE)
            built.append(TaskExample(task, example.input_ids[None], context_length,
                                     (example.answer_start, example.answer_end)))
        check_example(built[-1], continuation_length)
    return built


def check_example(example: TaskExample, continuation_length: int) -> None:
    """A CurKVError when a synthetic example did not fit its context or continuation."""
    total = example.input_ids.shape[-1]
    if total != example.context_length + continuation_length:
        raise CurKVError(f"{example.task}: a context of {example.context_length} tokens cannot hold the task's "
                         f"text after the protected sinks and window (got {total - continuation_length} "
                         "tokens); raise --context-length / --passkey-lengths")
    if example.answer is not None and not 1 <= example.answer[0] < example.answer[1] <= continuation_length:
        raise CurKVError(f"{example.task}: the question and answer need {example.answer[1]} continuation tokens, "
                         f"more than --continuation-length {continuation_length}")
