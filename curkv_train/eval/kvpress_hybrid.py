"""kvpress's presses on a hybrid model (Gemma 3): the full-attention layers compressed, the sliding-window ones left.

kvpress 0.5.5 skips a Gemma 3 model's sliding-window layers only for ``Gemma3ForConditionalGeneration``; on the text
model it would compress them too. Its ExpectedAttention and the presses that reuse it call the model's rotary
embedding without the layer type Gemma 3's needs (one table per layer type). :func:`on_full_layers` runs a press the
way the runtime and training treat hybrid models (docs/design.md §7c): only full-attention layers are pressed, and
a rotary call without a layer type gets theirs.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager
from typing import TYPE_CHECKING, Iterator

from torch import nn
from transformers import PreTrainedModel

from curkv_train.core.observation import decoder_of
from curkv_train.runtime.hybrid import sliding_layers
from curkv_train.runtime.press import restore_rotary, snapshot_rotary

if TYPE_CHECKING:
    from kvpress.presses.base_press import BasePress

FULL = "full_attention"


class FullLayerRotary(nn.Module):
    """A rotary embedding whose calls without a layer type get the full-attention layers' tables; the model's own
    calls, which name theirs, are passed through."""

    def __init__(self, rotary: nn.Module) -> None:
        super().__init__()
        self.rotary = rotary

    def __getattr__(self, name: str):
        """The wrapped embedding's attributes (its per-type frequency tables, read by the scorers' rope code)."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("rotary"), name)

    def forward(self, x, position_ids, layer_type: str | None = None):
        """``rotary(x, position_ids, layer_type)`` (cos, sin), ``layer_type`` defaulting to full attention."""
        return self.rotary(x, position_ids, layer_type or FULL)


def _skipping(hook, sliding: frozenset[int]):
    """``hook`` (a press's forward hook) for every layer but the ``sliding`` ones, whose output passes untouched."""
    def forward_hook(module: nn.Module, input, kwargs: dict, output):
        return output if module.layer_idx in sliding else hook(module, input, kwargs, output)

    return forward_hook


@contextmanager
def on_full_layers(model: PreTrainedModel, press: "BasePress") -> Iterator[None]:
    """Inside the block ``press`` (to be entered as ``with press(model):``) compresses only ``model``'s full-attention
    layers, and kvpress's rotary calls get their layer type; on exit the model and the press are as they were. A
    model without sliding-window layers is left alone."""
    sliding = frozenset(sliding_layers(model))
    if not sliding:
        yield
        return
    decoder = decoder_of(model)
    rotary = decoder.rotary_emb
    needs_type = "layer_type" in inspect.signature(rotary.forward).parameters
    before = snapshot_rotary(model)
    press.forward_hook = _skipping(press.forward_hook, sliding)  # kvpress registers self.forward_hook
    if needs_type:
        decoder.rotary_emb = FullLayerRotary(rotary)
    try:
        yield
    finally:
        del press.forward_hook
        decoder.rotary_emb = rotary
        restore_rotary(before)
