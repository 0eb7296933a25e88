"""The LightningDataModule: a weighted mix of document and synthetic sources."""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from curkv_train.training.data.sampling import BlockSampler, ResumableLoader
from curkv_train.training.data.synthetic import BUILDERS, SYNTHETIC_TASKS, Example
from curkv_train.training.data.tokenized import token_stream
from curkv_train.core.errors import CurKVError, EmptySplitError
from curkv_train.models.base import load_tokenizer

DOCUMENT_KINDS = ("stdlib", "pydoc", "files", "hub")
log = logging.getLogger(__name__)


@dataclass
class DataSource:
    """One entry of the data mix.

    Attributes:
        kind: a document source (stdlib, pydoc, files, hub) or a synthetic task
            (passkey, kv_lookup, repeated_span).
        weight: relative sampling weight in the mix.
        path: file or folder for ``files``.
        name: dataset id for ``hub``.
        text_field: text column of jsonl/parquet/hub rows.
        filler: document source whose text fills synthetic contexts.
        val_fraction: share of documents held out for validation and evaluation.
        limit: at most this many documents (hub sources).
    """

    kind: str = "stdlib"
    weight: float = 1.0
    path: str | None = None
    name: str | None = None
    text_field: str = "text"
    filler: str = "pydoc"
    val_fraction: float = 0.1
    limit: int | None = None


class MixedBlocks(Dataset):
    """``context | continuation`` blocks sampled from weighted sources, deterministic per index.

    Args:
        streams: per source, the token stream its blocks or fillers come from.
        sources: the mix (same order as ``streams``).
        tokenizer: for the synthetic tasks' text.
        context_length, continuation_length: block shape.
        size: number of blocks (an epoch).
        seed: base seed; index i always gives the same block.
        protected: (n_sink, window) that synthetic answers must avoid.
    """

    def __init__(self, streams: list[np.ndarray], sources: list[DataSource], tokenizer, context_length: int,
                 continuation_length: int, size: int, seed: int, protected: tuple[int, int]) -> None:
        self.streams, self.sources, self.tokenizer = streams, sources, tokenizer
        self.context_length, self.continuation_length = context_length, continuation_length
        self.size, self.seed, self.protected = size, seed, protected
        weights = np.array([source.weight for source in sources], dtype=np.float64)
        self.cumulative = np.cumsum(weights / weights.sum())

    def __len__(self) -> int:
        return self.size

    def example(self, index: int) -> Example:
        """The block at ``index`` with its answer span."""
        rng = random.Random(self.seed * 1_000_003 + index)
        which = int(np.searchsorted(self.cumulative, rng.random(), side="right").clip(max=len(self.sources) - 1))
        source, stream = self.sources[which], self.streams[which]
        if source.kind in SYNTHETIC_TASKS:
            build = BUILDERS[source.kind]
            return build(self.tokenizer, stream, self.context_length, self.continuation_length, rng,
                         protected=self.protected)
        length = self.context_length + self.continuation_length
        start = rng.randrange(0, len(stream) - length + 1)
        return Example(torch.from_numpy(stream[start : start + length].copy()), self.context_length,
                       0, self.continuation_length)

    def __getitem__(self, index: int) -> dict:
        example = self.example(index)
        return {"input_ids": example.input_ids, "context_length": example.context_length}


class CurKVDataModule(L.LightningDataModule):
    """Batches of ``context | continuation`` token blocks from a weighted data mix.

    Args:
        tokenizer: model id or folder whose tokenizer to use (linked to the model's base).
        tokenizer_fallback: used when ``tokenizer`` cannot be loaded here.
        sources: the data mix; documents split by a stable hash into train / val.
        context_length: tokens in the compressed context.
        continuation_length: tokens after it that measure the compression.
        batch_size: blocks per batch.
        train_size, val_size: blocks per training epoch / validation pass.
        n_sink, window: always-kept tokens (linked to the model's), for validity checks.
        max_positions: the base model's position limit (0 = unchecked).
        num_workers: DataLoader workers.
        seed: sampling seed.
    """

    def __init__(self, tokenizer: str = "tiny-random-llama", tokenizer_fallback: str | None = None,
                 sources: list[DataSource] | None = None, context_length: int = 256, continuation_length: int = 64,
                 batch_size: int = 1, train_size: int = 1000, val_size: int = 16, n_sink: int = 4,
                 window: int = 64, max_positions: int = 0, num_workers: int = 0, seed: int = 0) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["sources"])
        self.sources = sources if sources is not None else [DataSource()]
        self.tokenizer_name, self.tokenizer_fallback = tokenizer, tokenizer_fallback
        self.context_length, self.continuation_length = context_length, continuation_length
        self.batch_size, self.train_size, self.val_size = batch_size, train_size, val_size
        self.n_sink, self.window, self.max_positions = n_sink, window, max_positions
        self.num_workers, self.seed = num_workers, seed
        self.tokenizer = None
        self.datasets: dict[str, MixedBlocks] = {}
        self.check_lengths()

    def check_lengths(self) -> None:
        """Reject block shapes the model or the compression cannot handle, and unknown source kinds."""
        check_block_shape(self.context_length, self.continuation_length, self.n_sink, self.window, self.max_positions)
        if not self.sources or any(source.weight < 0 for source in self.sources) or not sum(
                source.weight for source in self.sources) > 0:
            raise CurKVError(f"the data mix needs sources with weights >= 0 summing to more than 0, got "
                             f"{[source.weight for source in self.sources]}")
        for source in self.sources:
            if source.kind not in DOCUMENT_KINDS + SYNTHETIC_TASKS:
                raise CurKVError(f"unknown data source kind {source.kind!r}; expected one of "
                                 f"{', '.join(DOCUMENT_KINDS + SYNTHETIC_TASKS)}")

    def stream(self, source: DataSource, split: str) -> np.ndarray:
        """Token stream behind ``source`` in ``split`` (synthetic tasks use their filler's)."""
        kind = source.filler if source.kind in SYNTHETIC_TASKS else source.kind
        try:
            stream = token_stream(self.tokenizer, kind, split, val_fraction=source.val_fraction, path=source.path,
                                  name=source.name, text_field=source.text_field, limit=source.limit)
        except EmptySplitError:
            if split == "train":
                raise
            log.warning("%s has no held-out documents; validation reuses training text", kind)
            return self.stream(source, "train")
        check_stream_length(source, stream, split, self.context_length + self.continuation_length)
        return stream

    def setup(self, stage: str | None = None) -> None:
        """Tokenize (or read from cache) every source and build train / val blocks."""
        self.check_lengths()
        if self.tokenizer is None:
            self.tokenizer = load_tokenizer(self.tokenizer_name, fallback=self.tokenizer_fallback)
        for split, size, seed in (("train", self.train_size, self.seed), ("val", self.val_size, self.seed + 1)):
            streams = [self.stream(source, split) for source in self.sources]
            self.datasets[split] = MixedBlocks(streams, self.sources, self.tokenizer, self.context_length,
                                               self.continuation_length, size, seed, (self.n_sink, self.window))

    def set_block_shape(self, context_length: int | None = None, continuation_length: int | None = None) -> None:
        """Draw the next training blocks with this shape (None keeps a length); the curriculum calls this.

        Validation keeps the recipe's shape. A shape the model or the compression cannot take
        is a CurKVError (the same checks as the recipe's own shape).
        """
        train = self.datasets.get("train")
        context_length, continuation_length = self.check_shape(context_length, continuation_length)
        if train is not None:
            train.context_length, train.continuation_length = context_length, continuation_length

    def check_shape(self, context_length: int | None = None, continuation_length: int | None = None) -> tuple[int, int]:
        """The training block shape (None keeps a length), after the checks :meth:`set_block_shape` makes: a
        CurKVError for a shape the model or the compression cannot take, a training stream too short for it, or
        a synthetic task without room in it (one block of each drawn). Changes nothing; the curriculum checks
        every stage's shape with it when training starts."""
        train = self.datasets.get("train")
        context_length = context_length or (train.context_length if train else self.context_length)
        continuation_length = continuation_length or (train.continuation_length if train else self.continuation_length)
        check_block_shape(context_length, continuation_length, self.n_sink, self.window, self.max_positions)
        for source, stream in zip(train.sources, train.streams) if train is not None else ():
            check_stream_length(source, stream, "train", context_length + continuation_length)
            if source.kind in SYNTHETIC_TASKS:
                BUILDERS[source.kind](self.tokenizer, stream, context_length, continuation_length, random.Random(0),
                                      protected=train.protected)
        return context_length, continuation_length

    def train_dataloader(self) -> DataLoader:
        """Blocks in a fixed, rank-split order that resumes mid-epoch (see :mod:`curkv_train.training.data.sampling`)."""
        world, rank = (self.trainer.world_size, self.trainer.global_rank) if self.trainer is not None else (1, 0)
        sampler = BlockSampler(self.datasets["train"], num_replicas=world, rank=rank)
        return ResumableLoader(self.datasets["train"], batch_size=self.batch_size, sampler=sampler,
                               num_workers=self.num_workers, collate_fn=collate_blocks)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.datasets["val"], batch_size=self.batch_size, num_workers=self.num_workers,
                          collate_fn=collate_blocks)


def check_block_shape(context_length: int, continuation_length: int, n_sink: int, window: int,
                      max_positions: int) -> None:
    """A CurKVError for a block shape the compression or the model cannot take (max_positions 0 = unchecked)."""
    if context_length <= n_sink + window:
        raise CurKVError(f"context_length {context_length} must exceed n_sink + window ({n_sink} + {window}): "
                         "nothing would be compressible")
    if continuation_length < 1:
        raise CurKVError("continuation_length must be at least 1")
    total = context_length + continuation_length
    if max_positions and total > max_positions:
        raise CurKVError(f"context + continuation = {total} tokens exceeds the model's {max_positions} positions")


def check_stream_length(source: DataSource, stream: np.ndarray, split: str, block: int) -> None:
    """A CurKVError when ``stream`` (a document source's, or a synthetic task's filler) is shorter than one block."""
    if len(stream) < block:
        what = f"the filler of {source.kind}" if source.kind in SYNTHETIC_TASKS else "data source"
        raise CurKVError(f"{what} {source.path or source.name or source.kind!r} has only {len(stream)} {split} tokens, "
                         f"fewer than one block of {block}")


def collate_blocks(items: list[dict]) -> dict:
    """Stack blocks of equal shape: input_ids (batch, context + continuation), context_length int."""
    lengths = {item["context_length"] for item in items}
    if len(lengths) != 1:
        raise ValueError(f"blocks in a batch must share one context length, got {sorted(lengths)}")
    return {"input_ids": torch.stack([item["input_ids"] for item in items]), "context_length": lengths.pop()}
