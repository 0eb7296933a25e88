"""AppendBuffer: exact size when assigned, in-place appends within the headroom, content always right."""

import torch

from curkv_train.runtime.buffer import AppendBuffer


def test_assigned_tensor_is_held_at_its_exact_size():
    tensor = torch.randn(1, 2, 10, 4)
    buffer = AppendBuffer(tensor, dim=-2, headroom=8)
    assert buffer.nbytes() == tensor.numel() * tensor.element_size()
    assert torch.equal(buffer.view, tensor)


def test_appends_reallocate_once_per_headroom_and_keep_the_content():
    tensor = torch.randn(1, 2, 10, 4)
    buffer = AppendBuffer(tensor, dim=-2, headroom=3)
    steps = [torch.randn(1, 2, 1, 4) for _ in range(6)]
    pointers = []
    for step in steps:
        buffer.append(step)
        pointers.append(buffer.data.data_ptr())
    # growth at step 1 (room for 3 tokens, its own included), in place for 2 steps, growth again at step 4.
    assert len(set(pointers[:3])) == 1 and pointers[3] != pointers[2] and len(set(pointers[3:])) == 1
    assert torch.equal(buffer.view, torch.cat([tensor, *steps], dim=-2))
    assert buffer.data.shape[-2] == 10 + 6


def test_an_append_longer_than_the_headroom_gets_exactly_its_room():
    buffer = AppendBuffer(torch.randn(1, 2, 10, 4), dim=-2, headroom=3)
    buffer.append(torch.randn(1, 2, 5, 4))
    assert buffer.data.shape[-2] == 15
    buffer.append(torch.randn(1, 2, 2, 4))
    assert buffer.data.shape[-2] == 15 + 3


def test_appending_never_writes_into_the_assigned_tensor():
    backing = torch.zeros(1, 1, 6, 2)
    buffer = AppendBuffer(backing[:, :, :4], dim=-2, headroom=2)
    buffer.append(torch.ones(1, 1, 1, 2))
    assert torch.count_nonzero(backing) == 0
