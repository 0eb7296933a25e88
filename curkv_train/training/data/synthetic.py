"""Synthetic far-context tasks: passkey retrieval, key-value lookup, repeated spans.

Next-token continuations of natural text mostly reward keeping recent tokens; these
tasks make the continuation depend on tokens far back in the context (DESIGN §4,
data mix). Each builder returns an :class:`Example` of exactly
``context_length + continuation_length`` tokens with the answer span marked, so the
same builders serve training and the evaluation tasks.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from curkv_train.core.errors import CurKVError

SYNTHETIC_TASKS = ("passkey", "kv_lookup", "repeated_span")
Filler = Sequence[int] | np.ndarray  # token ids of the text that fills a context: a list or a 1-D array, never copied whole


@dataclass
class Example:
    """One ``context | continuation`` block.

    Attributes:
        input_ids: (context_length + continuation_length,) token ids.
        context_length: tokens that form the (compressed) context.
        answer_start, answer_end: the continuation positions [start, end) whose
            tokens are the answer (what a task scores).
    """

    input_ids: torch.Tensor
    context_length: int
    answer_start: int = 0
    answer_end: int = 0


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _check_room(task: str, needed: int, available: int, where: str) -> None:
    """A CurKVError when a task's fixed text does not fit its part of the block."""
    if needed > available:
        raise CurKVError(f"{task} needs {needed} tokens in the {where} but the block has room for {available}; "
                         "use longer contexts/continuations")


def _fit(tokens: list[int], filler: Filler, length: int, rng: random.Random) -> list[int]:
    """``tokens`` followed by a random stretch of ``filler``, cut to exactly ``length``."""
    need = max(0, length - len(tokens))
    start = rng.randrange(0, max(1, len(filler) - need))
    return (tokens + [int(token) for token in filler[start : start + need]])[:length]


def _depth_position(depth: float, low: int, high: int) -> int:
    """Token offset at fractional ``depth`` of [low, high]."""
    return low + int(round(depth * max(0, high - low)))


def passkey(tokenizer, filler: Filler, context_length: int, continuation_length: int,
            rng: random.Random, depth: float | None = None, protected: tuple[int, int] = (4, 64)) -> Example:
    """A pass key hidden at ``depth`` (0 = start, 1 = end) of the compressible context, asked for after it."""
    key = str(rng.randrange(10000, 100000))
    needle = _encode(tokenizer, f" The pass key is {key}. Remember it. {key} is the pass key. ")
    question = _encode(tokenizer, "\nWhat is the pass key? The pass key is")
    answer = _encode(tokenizer, f" {key}.")
    n_sink, window = protected
    _check_room("passkey", len(needle), context_length - n_sink - window, "compressible context")
    _check_room("passkey", len(question) + len(answer), continuation_length, "continuation")
    depth = rng.random() if depth is None else depth
    position = _depth_position(depth, n_sink, context_length - window - len(needle))
    context = _fit([], filler, context_length - len(needle), rng)
    context = context[:position] + needle + context[position:]
    continuation = _fit(question + answer, filler, continuation_length, rng)
    ids = torch.tensor(context + continuation)
    return Example(ids, context_length, len(question), len(question) + len(answer))


def kv_lookup(tokenizer, filler: Filler, context_length: int, continuation_length: int,
              rng: random.Random, protected: tuple[int, int] = (4, 64)) -> Example:
    """A context of ``ID k: v`` lines; the continuation asks for the value of an early ID."""
    lines, records = [], []
    while sum(len(line) for line in lines) < context_length:
        record = (str(rng.randrange(1000, 10000)), str(rng.randrange(10000, 100000)))
        records.append(record)
        lines.append(_encode(tokenizer, f"ID {record[0]}: {record[1]}\n"))
    context = [token for line in lines for token in line][:context_length]
    # Ask for a record that lies wholly in the compressible part of the context.
    offsets, total = [], 0
    for line in lines:
        offsets.append(total)
        total += len(line)
    candidates = [i for i, offset in enumerate(offsets)
                  if offset >= protected[0] and offset + len(lines[i]) <= context_length - protected[1]]
    asked = records[rng.choice(candidates)] if candidates else records[0]
    ids = [record[0] for record, offset in zip(records, offsets) if offset < context_length]
    if ids.count(asked[0]) > 1:  # an ID drawn twice has two values: ask one that is unique (a redraw only here,
        unique = [i for i in candidates if ids.count(records[i][0]) == 1]  # so other blocks stay as they were)
        asked = records[rng.choice(unique)] if unique else asked
    question = _encode(tokenizer, f"ID {asked[0]}:")
    answer = _encode(tokenizer, f" {asked[1]}")
    _check_room("kv_lookup", len(question) + len(answer), continuation_length, "continuation")
    continuation = _fit(question + answer, filler, continuation_length, rng)
    return Example(torch.tensor(context + continuation), context_length, len(question), len(question) + len(answer))


def repeated_span(tokenizer, filler: Filler, context_length: int, continuation_length: int,
                  rng: random.Random, depth: float | None = None, protected: tuple[int, int] = (4, 64),
                  cue_length: int = 8) -> Example:
    """The continuation repeats a stretch of the compressible context starting at ``depth``.

    The first ``cue_length`` repeated tokens locate the span; the rest is the answer
    (long-range recall: predicting them needs the early tokens kept).
    """
    n_sink, window = protected
    span = min(continuation_length, max(cue_length + 1, context_length - n_sink - window))
    depth = rng.random() if depth is None else depth
    start = _depth_position(depth, n_sink, context_length - window - span)
    context = _fit([], filler, context_length, rng)
    continuation = _fit(context[start : start + span], filler, continuation_length, rng)
    return Example(torch.tensor(context + continuation), context_length, cue_length, span)


BUILDERS = {"passkey": passkey, "kv_lookup": kv_lookup, "repeated_span": repeated_span}
