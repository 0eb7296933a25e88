"""Dense per-token tensors with headroom: a decode step copies its new token, not the whole cache.

A transformers DynamicCache concatenates every step, copying all it holds; at long contexts
that copy is a large share of a CPU decode step. :class:`AppendBuffer` keeps a tensor with spare
room along its token dimension: an append writes into the room, and only when it runs out is
the tensor copied once into a larger one, with room for ``headroom`` tokens counted from the
append that needed it (or for that append alone, if it is longer). A tensor
assigned whole (a compression) or appended to an empty buffer (a prefill) is held at its exact size,
contiguous (a copy only where it is not); the room is only added by the first append that needs it.
The headroom is allocated memory, so it is counted as held (:meth:`AppendBuffer.nbytes`).
"""

from __future__ import annotations

import torch


class AppendBuffer:
    """A tensor growing along dimension ``dim`` with ``headroom`` spare tokens.

    Args:
        tensor: the initial content; its size along ``dim`` is the token count.
        dim: the token dimension (negative, counted from the end).
        headroom: tokens an append that has to reallocate makes room for, itself included (the cache's
            window: a compression replaces the tensor every one or few windows).
    """

    def __init__(self, tensor: torch.Tensor, dim: int, headroom: int) -> None:
        self.dim, self.headroom, self.length = dim, headroom, tensor.shape[dim]
        self.data = tensor
        self._content: torch.Tensor | None = tensor  # the view :attr:`view` gives, made once per append

    def _allocate(self, content: torch.Tensor, capacity: int) -> torch.Tensor:
        shape = list(content.shape)
        shape[self.dim] = capacity
        data = content.new_empty(shape)
        if content.shape[self.dim]:  # a prefill's first append starts from nothing: no copy to launch
            data.narrow(self.dim, 0, content.shape[self.dim]).copy_(content)
        return data

    @property
    def view(self) -> torch.Tensor:
        """The content (a view of the first ``length`` tokens), made once after each append: each view is an operator,
        and a layer reads its keys, values and positions many times between appends."""
        if self._content is None:
            self._content = self.data.narrow(self.dim, 0, self.length)
        return self._content

    def append(self, new: torch.Tensor, headroom: int | None = None) -> None:
        """Add ``new`` (same shape but along ``dim``) after the content; copies it all only when full, then with
        room for ``headroom`` tokens (default: the buffer's) counted from this append."""
        count = new.shape[self.dim]
        if self.data.shape[self.dim] == 0:  # a first append (a prefill) is held at its exact size: one copy at most
            self.data = self._content = new.contiguous()  # contiguous, as every later content (one compiled graph)
            self.length = count
            return
        if self.length + count > self.data.shape[self.dim]:
            room = self.headroom if headroom is None else headroom
            self.data = self._allocate(self.view, self.length + max(count, room))
        else:  # a reallocated tensor is made in the current mode; the one written into may not have been
            self.data = writable(self.data)
        self.data.narrow(self.dim, self.length, count).copy_(new)
        self.length += count
        self._content = None

    def nbytes(self) -> int:
        """Bytes allocated, headroom included."""
        return self.data.numel() * self.data.element_size()


def writable(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, or a copy where it cannot be written in place here: made under ``torch.inference_mode`` (a
    prefill run there) and written outside it (decoding under ``no_grad``, as ``generate`` does)."""
    return tensor.clone() if tensor.is_inference() and not torch.is_inference_mode_enabled() else tensor


def _slot(name: str) -> str:
    """Where the owner keeps the buffer behind property ``name``."""
    return f"_{name}_buffer"


def buffer_of(owner, name: str) -> AppendBuffer | None:
    """The :class:`AppendBuffer` behind ``owner``'s :func:`buffered` property ``name`` (None if unset)."""
    return owner.__dict__.get(_slot(name))


def buffered(name: str, dim: int) -> property:
    """A property storing tensors assigned to it in an :class:`AppendBuffer` (``None`` stays ``None``);
    reading it gives the content. The owner sets ``buffer_headroom`` (tokens)."""
    slot = _slot(name)

    def get(owner):
        buffer = owner.__dict__.get(slot)
        return None if buffer is None else buffer.view

    def set_(owner, tensor):
        owner.__dict__[slot] = None if tensor is None else AppendBuffer(tensor, dim, owner.buffer_headroom)

    return property(get, set_)
