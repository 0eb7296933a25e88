"""Block order: the same global batches for any split over ranks, fresh blocks each epoch, resumable mid-epoch."""

import pytest

from curkv_train.training.data.sampling import BlockSampler, ResumableLoader


class Blocks:
    """12 blocks; like MixedBlocks, any index gives a block (here: the index itself)."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, index: int) -> int:
        return index


BLOCKS = Blocks()


def global_batches(world: int, per_rank_batch: int, epoch: int = 0) -> list[list[int]]:
    """Per step, the sorted union of every rank's batch."""
    loaders = []
    for rank in range(world):
        sampler = BlockSampler(BLOCKS, num_replicas=world, rank=rank)
        sampler.set_epoch(epoch)
        loaders.append(ResumableLoader(BLOCKS, batch_size=per_rank_batch, sampler=sampler))
    per_rank = [[batch.tolist() for batch in loader] for loader in loaders]
    return [sorted(sum(step, [])) for step in zip(*per_rank)]


@pytest.mark.parametrize(("world", "per_rank_batch"), [(2, 2), (4, 1)])
def test_global_batches_do_not_depend_on_the_split_over_ranks(world, per_rank_batch):
    assert global_batches(world, per_rank_batch) == global_batches(1, 4) == [[0, 1, 2, 3], [4, 5, 6, 7],
                                                                           [8, 9, 10, 11]]


def test_each_epoch_draws_fresh_blocks():
    assert global_batches(1, 4, epoch=1)[0] == [12, 13, 14, 15]


def test_resumed_loader_skips_the_batches_already_trained_on():
    loader = ResumableLoader(BLOCKS, batch_size=2, sampler=BlockSampler(BLOCKS))
    iterator = iter(loader)
    seen = [next(iterator).tolist() for _ in range(2)]
    state = loader.state_dict()
    assert state == {"batches_done": 2, "epoch": 0} and seen == [[0, 1], [2, 3]]

    resumed = ResumableLoader(BLOCKS, batch_size=2, sampler=BlockSampler(BLOCKS))
    resumed.load_state_dict(state)
    assert len(resumed) == 6  # a whole epoch: Lightning counts the 2 restored batches itself
    assert [batch.tolist() for batch in resumed] == [[4, 5], [6, 7], [8, 9], [10, 11]]
    assert resumed.state_dict() == {"batches_done": 6, "epoch": 0}
    assert len(resumed) == 6 and len([batch for batch in resumed]) == 6  # the next epoch is whole again


def test_a_loader_resumed_into_another_epoch_starts_it_whole():
    """A checkpoint saved as fit ended part-way through epoch 0, resumed where Lightning starts epoch 1."""
    resumed = ResumableLoader(BLOCKS, batch_size=2, sampler=BlockSampler(BLOCKS))
    resumed.load_state_dict({"batches_done": 2, "epoch": 0})
    resumed.sampler.set_epoch(1)
    assert [batch.tolist() for batch in resumed][0] == [12, 13]


@pytest.mark.parametrize("drop_last", [False, True])
def test_a_loader_resumed_after_a_whole_epoch_starts_the_next_one_whole(drop_last):
    sampler = BlockSampler(BLOCKS)
    loader = ResumableLoader(BLOCKS, batch_size=5, sampler=sampler, drop_last=drop_last)
    assert len([batch for batch in loader]) == loader.batches_per_epoch() == (2 if drop_last else 3)
    resumed = ResumableLoader(BLOCKS, batch_size=5, sampler=BlockSampler(BLOCKS), drop_last=drop_last)
    resumed.load_state_dict(loader.state_dict())
    assert len(resumed) == loader.batches_per_epoch()  # not 0: Lightning would end the run with nothing trained
