"""The streaming task's documents: long held-out pieces cut to one length (:mod:`curkv_train.eval.streaming`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from curkv_train.core.errors import CurKVError
from curkv_train.eval.heldout import PYTHON_TEXT, DocumentSource, HeldOutDocument, held_out_documents

# task -> the document source kind it reads
STREAM_TASKS = {"stream_text": PYTHON_TEXT, "stream_code": "stdlib"}


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
