"""Training-block order that survives a restart and does not depend on how a batch is split over ranks.

:class:`~curkv_train.training.data.datamodule.MixedBlocks` already draws a random block for
every index, so the loader does not shuffle: position p of epoch e is block
``e·size + p`` (fresh blocks each epoch), and rank r of W takes the positions
p ≡ r (mod W). Global batch t is then positions [t·B·W, (t+1)·B·W) whatever the
split of B·W into ranks × per-rank batch, so 2 processes × batch 1 see the same
blocks as 1 process × batch 2.

:class:`ResumableLoader` records how many batches of the epoch were handed out;
Lightning stores that in the checkpoint (loaders with ``state_dict`` /
``load_state_dict`` are resumable) and the resumed run skips exactly those.
"""

from __future__ import annotations

from collections.abc import Iterator

from torch.utils.data import DataLoader, Dataset, DistributedSampler


class BlockSampler(DistributedSampler):
    """In-order block indices of one rank, fresh each epoch, optionally starting part-way.

    A ``DistributedSampler`` so Lightning keeps it under DDP/FSDP instead of injecting its own.

    Args:
        dataset: the blocks (only its length is used).
        num_replicas: world size W.
        rank: this process's global rank r.
    """

    def __init__(self, dataset: Dataset, num_replicas: int = 1, rank: int = 0) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=False, drop_last=False)
        self.start = 0  # samples of this rank's epoch already consumed (set on resume)

    def __iter__(self) -> Iterator[int]:
        size = len(self.dataset)
        positions = range(self.rank + self.start * self.num_replicas, self.total_size, self.num_replicas)
        # Past the end, positions wrap like DistributedSampler's padding.
        return iter([self.epoch * size + position % size for position in positions])

    def __len__(self) -> int:
        return self.num_samples - self.start


class ResumableLoader(DataLoader):
    """A DataLoader over a :class:`BlockSampler` that saves and restores its place in the epoch.

    ``state_dict()["batches_done"]`` counts the batches handed out in the current
    epoch (Lightning does not fetch ahead of a loader with a length, so handed out
    means trained on). After ``load_state_dict``, the next iteration of that epoch starts
    after those batches; ``len()`` is always a whole epoch's (Lightning counts the restored batches itself).
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if not isinstance(self.sampler, BlockSampler):
            raise TypeError(f"ResumableLoader needs a BlockSampler, got {type(self.sampler).__name__}")
        self.batches_done = 0
        self._resume_at = 0
        self._resume_epoch: int | None = None

    def __iter__(self) -> Iterator:
        start, self._resume_at = self._resume_at, 0
        if self._resume_epoch is not None and self._resume_epoch != self.sampler.epoch:
            start = 0  # Lightning went on to the next epoch (a checkpoint saved as fit ended part-way through one)
        self._resume_epoch = None
        self.sampler.start = start * self.batch_size
        self.batches_done = start
        return self._counted(super().__iter__())

    def _counted(self, batches: Iterator) -> Iterator:
        for batch in batches:
            self.batches_done += 1
            yield batch
        self.sampler.start = 0  # the next epoch is whole

    def __len__(self) -> int:
        # the whole epoch, also when resumed: Lightning restores its own count of the batches done and ends the
        # epoch when that count reaches this length
        return self.batches_per_epoch()

    def state_dict(self) -> dict:
        """Position in the epoch: {"batches_done": int, "epoch": int}."""
        return {"batches_done": self.batches_done, "epoch": self.sampler.epoch}

    def load_state_dict(self, state: dict) -> None:
        """Resume after ``state["batches_done"]`` batches of ``state["epoch"]`` at the next iteration if it iterates
        that epoch, else from the start of the epoch it iterates; a whole epoch done (a checkpoint at an epoch's
        last batch) resumes at the start of the next one."""
        done = int(state.get("batches_done", 0))
        self._resume_at = 0 if done >= self.batches_per_epoch() else done
        self._resume_epoch = state.get("epoch")

    def batches_per_epoch(self) -> int:
        """Batches of a whole epoch of this rank."""
        samples = self.sampler.num_samples
        return samples // self.batch_size if self.drop_last else -(-samples // self.batch_size)
