"""Held-out evaluation text: a validation split with every span the training split holds cut out.

Documents go to train or validation by a hash of their id, but documents of one corpus can
quote each other: pydoc topics nest (``compound`` holds the text of ``if``, ``while``, ``try``
...), codec modules of the standard library repeat the same tables. So a validation document
is cut at every :data:`SPAN`-token span that also occurs in the training split of any document
source of the recipe (a rolling hash over token ids); the remaining pieces, joined by EOS like
documents, are the evaluation text.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from curkv_train.data.corpora import documents, split_of
from curkv_train.errors import CurKVError

SPAN = 50
_MULTIPLIER = np.uint64(0x9E3779B97F4A7C15)


@dataclass(frozen=True)
class DocumentSource:
    """Where a recipe's documents come from and which share of them it held out.

    Attributes:
        kind: document source kind (stdlib, pydoc, files, hub); a synthetic task's filler.
        val_fraction: share of document ids in the validation split (:func:`split_of`).
        path, name, text_field, limit: as in :class:`curkv_train.data.datamodule.DataSource`.
    """

    kind: str
    val_fraction: float
    path: str | None = None
    name: str | None = None
    text_field: str = "text"
    limit: int | None = None

    def arguments(self) -> dict:
        """Keyword arguments of :func:`curkv_train.data.tokenized.token_stream` for this source."""
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
    """Sorted span hashes of the training split of every source, and the sources that could not be read.

    A hub source that cannot be reached here, or a files source whose path is not on this
    machine, is reported, not fatal: the evaluation text is local (stdlib, pydoc) and the
    caller records what went unchecked.
    """
    from curkv_train.data.tokenized import token_stream
    from curkv_train.errors import EmptySplitError

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


@dataclass
class HeldOutText:
    """One evaluation token stream and how it was made.

    Attributes:
        tokens: (tokens,) int64 the pieces, each followed by EOS.
        kind: document source kind it reads.
        val_fraction: the split it reads (the recipe's, or the default).
        origin: ``scorer recipe`` or ``default``: where ``val_fraction`` came from.
        documents: validation documents read.
        pieces: pieces left after cutting.
        validation_tokens: tokens of the validation documents before cutting.
        removed_tokens: tokens cut (seen in training, or in pieces shorter than the span).
        unchecked: training sources that could not be read (hub sources offline).
    """

    tokens: np.ndarray
    kind: str
    val_fraction: float
    origin: str
    documents: int
    pieces: int
    validation_tokens: int
    removed_tokens: int
    unchecked: list[str]

    def record(self) -> dict:
        """Everything but the tokens, for results.json."""
        record = asdict(self)
        record.pop("tokens")
        return {**record, "span": SPAN}


def validation_documents(tokenizer, source: DocumentSource) -> list[np.ndarray]:
    """Token ids of every validation document of ``source`` (no special tokens), in document order."""
    texts = [document["text"] for document in documents(source.kind, path=source.path, name=source.name,
                                                         text_field=source.text_field, limit=source.limit)
             if split_of(document["id"], source.val_fraction) == "val" and document["text"].strip()]
    if not texts:
        raise CurKVError(f"data source {source.kind!r} has no validation documents at val_fraction "
                         f"{source.val_fraction}; nothing to evaluate on")
    return [np.asarray(ids, dtype=np.int64) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


def held_out_text(tokenizer, source: DocumentSource, seen: np.ndarray, unchecked: list[str], origin: str,
                  span: int = SPAN) -> HeldOutText:
    """The validation split of ``source`` with every span in ``seen`` (:func:`training_hashes`) cut out."""
    docs = validation_documents(tokenizer, source)
    pieces = [piece for ids in docs for piece in unseen_pieces(ids, seen, span)]
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    tokens = np.concatenate([np.concatenate([piece, np.asarray(eos, dtype=np.int64)]) for piece in pieces]
                            ) if pieces else np.empty(0, np.int64)
    total = sum(len(ids) for ids in docs)
    return HeldOutText(tokens, source.kind, source.val_fraction, origin, len(docs), len(pieces), total,
                       total - sum(len(piece) for piece in pieces), unchecked)
