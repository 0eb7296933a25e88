"""Token streams of document sources, tokenized once and cached on disk by ``datasets``."""

from __future__ import annotations

import hashlib

import numpy as np

from curkv_train.training.data.corpora import documents, split_of
from curkv_train.core.errors import CurKVError, EmptySplitError
from curkv_train.models.embedded import cache_root


def _split_documents(kind: str, split: str, val_fraction: float, path: str | None, name: str | None,
                     text_field: str, limit: int | None):
    for document in documents(kind, path=path, name=name, text_field=text_field, limit=limit):
        if split_of(document["id"], val_fraction) == split and document["text"].strip():
            yield document


def _content_fingerprint(kwargs: dict) -> str | None:
    """sha256 of a local source's split (its documents' ids and texts, and the split arguments), so the
    on-disk cache follows the corpus and not only the arguments; None for hub sources (read once only)."""
    if kwargs["kind"] == "hub":
        return None
    digest = hashlib.sha256(repr(sorted(kwargs.items())).encode())
    for document in _split_documents(**kwargs):
        for part in (document["id"], document["text"]):
            digest.update(part.encode("utf-8", errors="replace") + b"\0")
    return digest.hexdigest()[:32]


def token_stream(tokenizer, kind: str, split: str, *, val_fraction: float = 0.1, path: str | None = None,
                 name: str | None = None, text_field: str = "text", limit: int | None = None) -> np.ndarray:
    """All documents of one source and split, tokenized and joined by EOS: (tokens,) int64.

    ``datasets`` caches both the documents and their tokenization under the curkv
    cache folder, keyed by the documents' content (local sources; hub sources by their
    arguments), the split and the tokenizer.
    """
    from datasets import Dataset, Features, Value, disable_progress_bars

    disable_progress_bars()
    kwargs = dict(kind=kind, split=split, val_fraction=val_fraction, path=path, name=name,
                  text_field=text_field, limit=limit)
    where = path or name or kind
    if next(_split_documents(**kwargs), None) is None:
        raise EmptySplitError(f"data source {where!r} has no text in its {split} split")
    try:
        docs = Dataset.from_generator(_split_documents, gen_kwargs=kwargs, cache_dir=str(cache_root() / "datasets"),
                                      features=Features({"id": Value("string"), "text": Value("string")}),
                                      fingerprint=_content_fingerprint(kwargs))
    except Exception as error:  # datasets wraps generator errors; surface ours unchanged
        cause = error
        while cause is not None and not isinstance(cause, CurKVError):
            cause = cause.__cause__ or cause.__context__
        raise cause or error
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    tokens = docs.map(lambda batch: {"ids": [tokenizer(t, add_special_tokens=False)["input_ids"] + eos
                                              for t in batch["text"]]},
                      batched=True, remove_columns=docs.column_names)
    stream = np.fromiter((t for ids in tokens["ids"] for t in ids), dtype=np.int64)
    if stream.size == 0:
        raise EmptySplitError(f"data source {where!r} has no text in its {split} split")
    return stream
