"""ObservationBuffer: queries fed token by token give the observation one prefill of them gives."""

import pytest
import torch

from curkv_train.core.observation import QueryStatistics, observe_queries
from curkv_train.core.errors import CurKVError
from curkv_train.runtime.observer import ObservationBuffer

HEADS, DIM = 3, 4


def queries(tokens: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(2, HEADS, tokens, DIM, generator=torch.Generator().manual_seed(seed))


def fed(buffer: ObservationBuffer, all_queries: torch.Tensor, chunks: list[int], first: int = 0) -> ObservationBuffer:
    """``buffer`` after observing ``all_queries`` in chunks of the given sizes, the first at position ``first``."""
    start = 0
    for size in chunks:
        buffer.observe_queries(all_queries[:, :, start : start + size], first + start)
        start += size
    return buffer


@pytest.mark.parametrize("chunks", [[1] * 23, [5, 1, 1, 9, 1, 6], [3, 20], [7] + [1] * 16])
def test_chunked_queries_give_the_observation_of_one_prefill(chunks):
    all_queries = queries(sum(chunks))
    whole = fed(ObservationBuffer(8, None, statistics_skip=2), all_queries, [sum(chunks)]).observation()
    streamed = fed(ObservationBuffer(8, None, statistics_skip=2), all_queries, chunks).observation()
    assert torch.equal(streamed.queries, all_queries[:, :, -8:])
    assert streamed.positions.tolist() == list(range(sum(chunks) - 8, sum(chunks)))
    assert torch.equal(whole.queries, streamed.queries)
    assert streamed.statistics.count == sum(chunks) - 2
    torch.testing.assert_close(streamed.statistics.mean(), all_queries[:, :, 2:].mean(dim=2))
    torch.testing.assert_close(streamed.statistics.covariance(), whole.statistics.covariance())
    counted = all_queries[:, :, 2:]
    centred = counted - counted.mean(dim=2, keepdim=True)
    reference = centred.transpose(-1, -2) @ centred / counted.shape[2]
    torch.testing.assert_close(streamed.statistics.covariance(), reference)


@pytest.mark.parametrize("tokens", [23, 2, 1])
def test_a_prefill_observation_is_what_the_buffer_observes(tokens):
    """The scorer's and the press's prefill observation (observe_queries) and the cache's agree, short prefills too."""
    all_queries = queries(tokens)
    prefill = observe_queries(all_queries, 2)
    buffered = fed(ObservationBuffer(tokens, None, statistics_skip=2), all_queries, [tokens]).observation()
    assert prefill.positions.tolist() == list(range(tokens))
    assert prefill.statistics.count == max(tokens - 2, 0)
    if buffered is None:  # nothing counted: the buffer reports no observation
        assert tokens <= 2
        return
    assert torch.equal(prefill.queries, buffered.queries)
    torch.testing.assert_close(prefill.statistics.mean(), buffered.statistics.mean())


def test_query_moments_hold_the_packed_upper_triangle():
    statistics = QueryStatistics.of(queries(12))
    batch, heads, _, head_dim = queries(12).shape
    assert statistics.nbytes() == batch * heads * (head_dim + head_dim * (head_dim + 1) // 2) * 4


def test_window_shorter_than_what_was_seen_so_far_and_bytes_stay_bounded():
    buffer = fed(ObservationBuffer(8, None), queries(5), [1] * 5)
    observation = buffer.observation()
    assert observation.positions.tolist() == [0, 1, 2, 3, 4]
    torch.testing.assert_close(observation.queries, queries(5))
    held = buffer.nbytes()
    later = queries(40, seed=1)
    fed(buffer, later, [1] * 40, first=5)
    assert buffer.nbytes() == held
    assert torch.equal(buffer.observation().queries, later[:, :, -8:])
    assert buffer.observation().statistics.count == 45


def test_no_window_keeps_nothing():
    buffer = fed(ObservationBuffer(0, None), queries(10), [10])
    assert buffer.observation() is None and buffer.nbytes() == 0


def test_a_crop_within_the_window_forgets_the_dropped_queries():
    """Observe 6 of a window of 8, crop to 4, observe 2 others and 4 more: as if the dropped ones never came."""
    first, other = queries(10), queries(10, seed=1)
    replayed = torch.cat([first[:, :, :4], other[:, :, 4:]], dim=2)
    buffer = fed(ObservationBuffer(8, None), first, [4, 2])
    buffer.crop(4)
    cropped = fed(buffer, replayed[:, :, 4:], [2, 4], first=4).observation()
    fresh = fed(ObservationBuffer(8, None), replayed, [10]).observation()
    assert torch.equal(cropped.queries, fresh.queries) and cropped.statistics.count == fresh.statistics.count == 10
    torch.testing.assert_close(cropped.statistics.mean(), fresh.statistics.mean())


@pytest.mark.parametrize("chunks", [[4, 2], [9]], ids=["folded", "window_moved_on"])
def test_a_crop_the_observation_cannot_undo_is_refused_and_changes_nothing(chunks):
    """Window 4: after 4 queries the statistics count them (a fold); after 9 the ring lost positions 1-4."""
    buffer = fed(ObservationBuffer(4, None), queries(sum(chunks)), chunks)
    seen, unfolded = buffer.seen, buffer.unfolded
    with pytest.raises(CurKVError, match="cannot forget the queries of its last"):
        buffer.crop(sum(chunks) - 1)
    assert (buffer.seen, buffer.unfolded) == (seen, unfolded)


def test_a_prompt_within_the_skipped_tokens_scores_without_nans():
    """Statistics that counted no query (a prompt no longer than statistics_skip, as kvpress may hand a press)
    give a uniform expected attention, not NaN scores."""
    from curkv_train.core.observation import QueryStatistics, observe_queries

    statistics = observe_queries(torch.randn(1, 4, 3, 16), skip=4).statistics
    assert statistics.count == 0
    assert torch.equal(statistics.mean(), torch.zeros(1, 4, 16))
    assert torch.equal(statistics.covariance(), torch.zeros(1, 4, 16, 16))
    assert QueryStatistics.of(torch.randn(1, 4, 5, 16)).mean().isfinite().all()
