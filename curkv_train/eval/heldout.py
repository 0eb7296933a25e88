"""Held-out evaluation text: a validation split with every span the training split holds cut out.

Documents of one corpus quote each other (pydoc topics nest, codec modules repeat tables), so a validation
document is cut at every :data:`SPAN`-token span that also occurs in the training split of any source of
the recipe (a rolling hash over token ids); the pieces left, joined by EOS, are the evaluation text.
:data:`PYTHON_TEXT` reads the prose files CPython ships beside its standard library, which no training
source reads. The streaming task's long documents are cut from held-out ones (:func:`stream_documents`).
"""

from __future__ import annotations

import sysconfig
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from curkv_train.core.errors import CurKVError, EmptySplitError
from curkv_train.training.data.corpora import documents, split_of

SPAN = 50
PYTHON_TEXT = "python_text"
# Prose files of CPython's standard-library folder that no training source reads (relative to its root).
PYTHON_TEXT_FILES = ("idlelib/NEWS.txt", "idlelib/NEWS2x.txt", "idlelib/HISTORY.txt", "idlelib/README.txt",
                     "idlelib/TODO.txt", "idlelib/extend.txt", "idlelib/CREDITS.txt", "LICENSE.txt")
_MULTIPLIER = np.uint64(0x9E3779B97F4A7C15)


@dataclass(frozen=True)
class DocumentSource:
    """Where a recipe's documents come from (``kind``: stdlib, pydoc, files, hub; a synthetic task's filler) and the
    share of document ids in their validation split (``val_fraction``); the other fields as in
    :class:`~curkv_train.training.data.datamodule.DataSource`."""

    kind: str
    val_fraction: float
    path: str | None = None
    name: str | None = None
    text_field: str = "text"
    limit: int | None = None

    def arguments(self) -> dict:
        """Keyword arguments of :func:`curkv_train.training.data.tokenized.token_stream` for this source."""
        return {"val_fraction": self.val_fraction, "path": self.path, "name": self.name,
                "text_field": self.text_field, "limit": self.limit}


def span_hashes(ids: np.ndarray, span: int = SPAN) -> np.ndarray:
    """Polynomial hash (mod 2**64) of every ``span`` consecutive ids: (tokens,) -> (tokens - span + 1,) uint64."""
    ids = np.asarray(ids).astype(np.uint64) + np.uint64(1)  # id 0 still counts
    count = len(ids) - span + 1
    hashes = np.zeros(max(count, 0), dtype=np.uint64)
    if count <= 0:
        return hashes
    with np.errstate(over="ignore"):
        for offset in range(span):
            hashes *= _MULTIPLIER
            hashes += ids[offset : offset + count]
    return hashes


def training_hashes(tokenizer, sources: list[DocumentSource], span: int = SPAN) -> tuple[np.ndarray, list[str]]:
    """Sorted span hashes of the training split of every source, and the sources that could not be read (a hub
    source offline or a files path not here: reported, not fatal, as the evaluation text is local)."""
    from curkv_train.training.data.tokenized import token_stream

    parts, unchecked = [], []
    for source in dict.fromkeys(sources):
        try:
            stream = token_stream(tokenizer, source.kind, "train", **source.arguments())
        except EmptySplitError:
            continue
        except CurKVError:
            if source.kind not in ("hub", "files"):
                raise
            unchecked.append(f"{source.kind}:{source.name or source.path}")
            continue
        parts.append(span_hashes(stream, span))
    return (np.sort(np.concatenate(parts)) if parts else np.empty(0, np.uint64)), unchecked


def contains(sorted_hashes: np.ndarray, hashes: np.ndarray) -> np.ndarray:
    """(n,) bool: each of ``hashes`` occurs in ``sorted_hashes`` (sorted ascending; not re-sorted)."""
    if not len(sorted_hashes):
        return np.zeros(len(hashes), dtype=bool)
    where = np.searchsorted(sorted_hashes, hashes).clip(max=len(sorted_hashes) - 1)
    return sorted_hashes[where] == hashes


def seen_tokens(ids: np.ndarray, seen: np.ndarray, span: int = SPAN) -> np.ndarray:
    """(tokens,) bool: the token lies in a ``span``-token window whose hash is in ``seen`` (sorted)."""
    hashes = span_hashes(ids, span)
    starts = np.flatnonzero(contains(seen, hashes))
    cover = np.zeros(len(ids) + 1, dtype=np.int64)
    np.add.at(cover, starts, 1)
    np.add.at(cover, starts + span, -1)
    return np.cumsum(cover)[: len(ids)] > 0


def unseen_pieces(ids: np.ndarray, seen: np.ndarray, span: int = SPAN) -> list[np.ndarray]:
    """The runs of ``ids`` outside every window in ``seen``, runs shorter than ``span`` dropped."""
    removed = seen_tokens(ids, seen, span)
    edges = np.flatnonzero(np.diff(np.concatenate([[True], removed, [True]]).astype(np.int8)))
    runs = zip(edges[0::2], edges[1::2])  # [start, stop) of each run of kept tokens
    return [ids[start:stop] for start, stop in runs if stop - start >= span]


@dataclass(frozen=True)
class HeldOutDocument:
    """One held-out document after cutting: its ``id`` (``stdlib/ipaddress.py``, ...), ``tokens`` (tokens,) int64 the
    ``pieces`` left, each followed by EOS (empty when nothing was left), and its ``original_tokens`` count."""

    id: str
    tokens: np.ndarray
    pieces: int
    original_tokens: int


@dataclass
class HeldOutText:
    """One evaluation token stream and how it was made: ``tokens`` (tokens,) int64, the pieces each followed by EOS;
    the source ``kind`` and ``val_fraction`` it reads (``a+b`` for a stream joined from ``parts``, their records), and
    its ``origin`` (``scorer recipe``, ``default`` or ``never trained``); validation ``documents`` read, ``pieces``
    left, ``validation_tokens`` before cutting and ``removed_tokens`` cut; ``unchecked`` training sources that
    could not be read; ``document_ids`` (tokens,) the index into ``names`` of each token's document."""

    tokens: np.ndarray
    kind: str
    val_fraction: float | None
    origin: str
    documents: int
    pieces: int
    validation_tokens: int
    removed_tokens: int
    unchecked: list[str]
    document_ids: np.ndarray = field(default_factory=lambda: np.empty(0, np.int32))
    names: list[str] = field(default_factory=list)
    parts: list[dict] = field(default_factory=list)

    def record(self) -> dict:
        """Everything but the tokens, for results.json (``names``: the documents read)."""
        record = asdict(self)
        for key in ("tokens", "document_ids"):
            record.pop(key)
        if not record["parts"]:
            record.pop("parts")
        return {**record, "span": SPAN}

    def documents_between(self, start: int, stop: int) -> list[str]:
        """Ids of the documents tokens [start, stop) of the stream came from, in stream order."""
        return [self.names[index] for index in dict.fromkeys(self.document_ids[start:stop].tolist())]

    def main_document(self, start: int, stop: int) -> str:
        """Id of the document most of tokens [start, stop) came from (among equals the first in stream order),
        or "" for a stream without document ids."""
        if not len(self.document_ids):
            return ""
        return self.names[int(np.bincount(self.document_ids[start:stop]).argmax())]


def python_text_documents() -> Iterator[dict]:
    """The :data:`PYTHON_TEXT_FILES` present here, as documents ``{"id": "python_text/<path>", "text"}``."""
    root = Path(sysconfig.get_paths()["stdlib"])
    for relative in PYTHON_TEXT_FILES:
        path = root / relative
        if path.is_file():
            text = path.read_text(encoding="utf-8", errors="replace")
            if text.strip():
                yield {"id": f"{PYTHON_TEXT}/{relative}", "text": text}


def _held_out_raw(source: DocumentSource) -> list[dict]:
    """The documents of ``source`` outside its training split (every ``python_text`` document)."""
    if source.kind == PYTHON_TEXT:
        return list(python_text_documents())
    return [document for document in documents(source.kind, path=source.path, name=source.name,
                                                 text_field=source.text_field, limit=source.limit)
            if split_of(document["id"], source.val_fraction) == "val"]


def validation_documents(tokenizer, source: DocumentSource) -> list[tuple[str, np.ndarray]]:
    """(id, token ids) of every validation document of ``source`` (no special tokens), in document order."""
    raw = [document for document in _held_out_raw(source) if document["text"].strip()]
    if not raw:
        raise CurKVError(f"data source {source.kind!r} has no validation documents at val_fraction "
                         f"{source.val_fraction}; nothing to evaluate on")
    encoded = tokenizer([document["text"] for document in raw], add_special_tokens=False)["input_ids"]
    return [(document["id"], np.asarray(ids, dtype=np.int64)) for document, ids in zip(raw, encoded)]


def held_out_documents(tokenizer, source: DocumentSource, seen: np.ndarray, span: int = SPAN) -> list[HeldOutDocument]:
    """Every validation document of ``source`` with the spans in ``seen`` (:func:`training_hashes`) cut out."""
    eos = np.asarray([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [], dtype=np.int64)
    held = []
    for name, ids in validation_documents(tokenizer, source):
        pieces = unseen_pieces(ids, seen, span)
        tokens = np.concatenate([part for piece in pieces for part in (piece, eos)]) if pieces else ids[:0]
        held.append(HeldOutDocument(name, tokens, len(pieces), len(ids)))
    return held


def held_out_text(tokenizer, source: DocumentSource, seen: np.ndarray, unchecked: list[str], origin: str,
                  span: int = SPAN) -> HeldOutText:
    """The validation split of ``source`` with every span in ``seen`` (:func:`training_hashes`) cut out."""
    docs = held_out_documents(tokenizer, source, seen, span)
    kept = [doc for doc in docs if len(doc.tokens)]
    tokens = np.concatenate([doc.tokens for doc in kept]) if kept else np.empty(0, np.int64)
    owners = (np.concatenate([np.full(len(doc.tokens), index, np.int32) for index, doc in enumerate(kept)])
              if kept else np.empty(0, np.int32))
    total = sum(doc.original_tokens for doc in docs)
    pieces = sum(doc.pieces for doc in docs)
    removed = total - (len(tokens) - pieces * (1 if tokenizer.eos_token_id is not None else 0))
    return HeldOutText(tokens, source.kind, source.val_fraction, origin, len(docs), pieces, total, removed,
                       unchecked, owners, [doc.id for doc in kept])


def join_texts(parts: list[HeldOutText]) -> HeldOutText:
    """One stream of several, in order (``kind`` ``a+b``; each part's record kept in ``parts``)."""
    if len(parts) == 1:
        return parts[0]
    names, owners, offset = [], [], 0
    for part in parts:
        names += part.names
        owners.append(part.document_ids + offset)
        offset += len(part.names)
    unchecked = list(dict.fromkeys(name for part in parts for name in part.unchecked))
    return HeldOutText(np.concatenate([part.tokens for part in parts]), "+".join(part.kind for part in parts), None,
                       ", ".join(dict.fromkeys(part.origin for part in parts)), sum(part.documents for part in parts),
                       sum(part.pieces for part in parts), sum(part.validation_tokens for part in parts),
                       sum(part.removed_tokens for part in parts), unchecked, np.concatenate(owners), names,
                       [part.record() for part in parts])


# streaming task -> the document source kind it reads
STREAM_TASKS = {"stream_text": PYTHON_TEXT, "stream_code": "stdlib"}


@dataclass(frozen=True)
class StreamDocument:
    """One document of the streaming task: its ``task``, ``input_ids`` (1, tokens) and the ids of the held-out
    documents its tokens came from (``sources``, in order)."""

    task: str
    input_ids: torch.Tensor
    sources: tuple[str, ...]


def stream_documents(task: str, held_out: list[HeldOutDocument], *, length: int, count: int) -> list[StreamDocument]:
    """Up to ``count`` documents of ``length`` tokens from as many different files as there are.

    First the blocks single held-out documents hold, one per document (longest first), then each one's
    second block, and so on; then the rest (short documents and long ones' tails, longest first) joined
    and cut into blocks. A CurKVError when all of them hold fewer than ``length`` tokens.
    """
    ordered = sorted((doc for doc in held_out if len(doc.tokens)), key=lambda doc: (-len(doc.tokens), doc.id))
    if sum(len(doc.tokens) for doc in ordered) < length:
        raise CurKVError(f"{task}: the held-out documents hold {sum(len(doc.tokens) for doc in ordered)} tokens, "
                         f"fewer than one streamed document of {length}; lower --stream_length")
    whole = sorted((depth, order) for order, doc in enumerate(ordered) for depth in range(len(doc.tokens) // length))
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
    """The documents of every streaming task (``sources``: the source each reads; ``seen``: the training split's
    span hashes, cut out)."""
    return {task: stream_documents(task, held_out_documents(tokenizer, sources[task], seen), length=length,
                                   count=count) for task in tasks}
