"""Count what a CurKVCache prefill, or decode step, dispatches beyond a plain one: aten operators and Triton
launches, per layer.

On a GPU each aten operator is a kernel launch or a sync point, so the count says what scoring
costs where it is launch-bound, measured on any machine. Views and metadata-only operators
(``view``, ``expand``, ``size`` ...) are counted too: the dispatcher pays for each call.
"""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager
from typing import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import DynamicCache, PreTrainedModel


class OperatorCounter(TorchDispatchMode):
    """Counts every aten operator dispatched while active, by name (``counts``) and in all (``total``)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.counts.values())


@contextmanager
def counting_triton_launches() -> Iterator[Counter[str]]:
    """Counts Triton kernel launches (``JITFunction.run``) by kernel name while active; empty without Triton."""
    launches: Counter[str] = Counter()
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:
        yield launches
        return
    original = JITFunction.run

    def run(self, *args, **kwargs):
        launches[self.fn.__name__] += 1
        return original(self, *args, **kwargs)

    JITFunction.run = run
    try:
        yield launches
    finally:
        JITFunction.run = original


@torch.no_grad()
def dispatched(model: PreTrainedModel, ids: torch.Tensor, cache) -> tuple[Counter[str], Counter[str]]:
    """(aten operators, Triton launches) of one prefill of ``ids`` (1, tokens) into ``cache``, last logits only."""
    with counting_triton_launches() as launches, OperatorCounter() as counter:
        model(ids, past_key_values=cache, logits_to_keep=1)
    return counter.counts, launches


def added_per_layer(model: PreTrainedModel, make_cache, context: int, seed: int = 0) -> dict:
    """What a prefill of ``context`` random tokens into ``make_cache()`` dispatches beyond one into a DynamicCache,
    per decoder layer: ``operators`` (aten operators and Triton launches together), and each apart, after one
    warm-up prefill of each (first-call work such as building RoPE tables is not counted)."""
    ids = torch.randint(0, model.config.vocab_size, (1, context), generator=torch.Generator().manual_seed(seed))
    ids = ids.to(model.device)
    runs = {}
    for name, build in (("plain", lambda: DynamicCache(config=model.config)), ("cache", make_cache)):
        dispatched(model, ids, build())
        runs[name] = dispatched(model, ids, build())
    aten, triton, plain = added(runs, model.config.num_hidden_layers)
    return {"context": context, "aten_per_layer": aten, "triton_per_layer": triton, "operators_per_layer": aten + triton,
            "plain_aten_per_layer": plain,
            "top_added": (runs["cache"][0] - runs["plain"][0]).most_common(8)}


def added(runs: dict[str, tuple[Counter[str], Counter[str]]], units: int) -> tuple[float, float, float]:
    """(aten operators, Triton launches) the ``cache`` run dispatched beyond the ``plain`` one, and the plain run's
    aten operators, each per unit (``units``: layers, or layers × steps)."""
    aten = (sum(runs["cache"][0].values()) - sum(runs["plain"][0].values())) / units
    triton = (sum(runs["cache"][1].values()) - sum(runs["plain"][1].values())) / units
    return aten, triton, sum(runs["plain"][0].values()) / units


@torch.no_grad()
def decode_added_per_layer(model: PreTrainedModel, make_cache, context: int, steps: int, seed: int = 0) -> dict:
    """What ``steps`` greedy decode steps through ``make_cache()`` dispatch beyond the same steps through a
    DynamicCache, per decoder layer and step, after a prefill of ``context`` random tokens (the re-compressions
    among the steps included): ``operators`` (aten operators and Triton launches) and each apart."""
    ids = torch.randint(0, model.config.vocab_size, (1, context), generator=torch.Generator().manual_seed(seed))
    runs = {}
    for name, build in (("plain", lambda: DynamicCache(config=model.config)), ("cache", make_cache)):
        cache = build()
        token = model(ids.to(model.device), past_key_values=cache, logits_to_keep=1).logits[:, -1:].argmax(-1)
        with counting_triton_launches() as launches, OperatorCounter() as counter:
            for _ in range(steps):
                token = model(token, past_key_values=cache, logits_to_keep=1).logits[:, -1:].argmax(-1)
        runs[name] = (counter.counts, launches)
    aten, triton, plain = added(runs, model.config.num_hidden_layers * steps)
    return {"context": context, "steps": steps, "aten_per_layer_step": aten, "triton_per_layer_step": triton,
            "operators_per_layer_step": aten + triton, "plain_aten_per_layer_step": plain}
