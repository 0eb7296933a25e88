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
    steps = [torch.randn(1, 2, 1, 4) for _ in range(7)]
    pointers = []
    for step in steps:
        buffer.append(step)
        pointers.append(buffer.data.data_ptr())
    # growth at step 1 (room for 3 more), then in place for 3 steps, growth again at step 5.
    assert len(set(pointers[:4])) == 1 and pointers[4] != pointers[3] and len(set(pointers[4:])) == 1
    assert torch.equal(buffer.view, torch.cat([tensor, *steps], dim=-2))
    assert buffer.data.shape[-2] == 10 + 5 + 3


def test_appending_never_writes_into_the_assigned_tensor():
    backing = torch.zeros(1, 1, 6, 2)
    buffer = AppendBuffer(backing[:, :, :4], dim=-2, headroom=2)
    buffer.append(torch.ones(1, 1, 1, 2))
    assert torch.count_nonzero(backing) == 0
