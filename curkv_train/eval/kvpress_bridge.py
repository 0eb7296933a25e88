"""kvpress's own presses through the same harness, as a cross-check of our baselines.

A press compresses inside the prefill (``with press(model): model(context)``); the
continuation and its scoring are then the same as for every other method. kvpress
keeps ``int(n·(1 − compression_ratio))`` of all n tokens, with no protected sinks or
window unless the press protects them itself. With ``budget="matched"`` the press's
compression ratio is set so it keeps exactly as many tokens as our selection path
(sinks + window + ⌈ρ·n_compressible⌉); with ``"nominal"`` it gets the ratio as given.
Either way the measured kept tokens and bytes are reported.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel

from curkv_train.errors import CurKVError
from curkv_train.core.selection import expected_kept

# our name -> kvpress class name; presses a kvpress version lacks are skipped
PRESSES = {
    "streaming_llm": "StreamingLLMPress",
    "snapkv": "SnapKVPress",
    "tova": "TOVAPress",
    "knorm": "KnormPress",
    "expected_attention": "ExpectedAttentionPress",
    "observed_attention": "ObservedAttentionPress",
    "cur": "CURPress",
    "leverage": "LeverageScorePress",
    "random": "RandomPress",
}
EAGER_PRESSES = ("observed_attention",)
BUDGETS = ("matched", "nominal")
PREFIX = "kvpress:"


def _kvpress():
    try:
        import kvpress
    except ImportError as error:
        raise CurKVError("--kvpress needs the kvpress package: pip install 'curkv-train[kvpress]'") from error
    return kvpress


def available_presses() -> list[str]:
    """Names (keys of :data:`PRESSES`) of the presses the installed kvpress provides."""
    kvpress = _kvpress()
    return [name for name, cls in PRESSES.items() if hasattr(kvpress, cls)]


def press_ratio(context_length: int, compression_ratio: float, *, n_sink: int, window: int, budget: str) -> float:
    """The compression ratio handed to a kvpress press for a context of ``context_length`` tokens."""
    if budget not in BUDGETS:
        raise CurKVError(f"unknown kvpress budget {budget!r}; expected one of {', '.join(BUDGETS)}")
    if budget == "nominal":
        return compression_ratio
    kept = expected_kept(context_length, n_sink, window, 1.0 - compression_ratio)
    # int(n · (kept + 0.5) / n) == kept, free of float truncation
    return max(0.0, 1.0 - (kept + 0.5) / context_length)


def make_press(name: str, compression_ratio: float, *, n_sink: int, window: int, seed: int):
    """A kvpress press ``name`` with its hyper-parameters aligned with ours (sinks, SnapKV window)."""
    kvpress = _kvpress()
    cls = getattr(kvpress, PRESSES[name])
    extra = {"streaming_llm": {"n_sink": n_sink}, "expected_attention": {"n_sink": n_sink},
             "cur": {"num_sinks": n_sink}, "snapkv": {"window_size": window}, "random": {"seed": seed}}
    return cls(compression_ratio=compression_ratio, **extra.get(name, {}))


@torch.no_grad()
def press_cache(model: PreTrainedModel, name: str, press, context_ids: torch.Tensor, seed: int) -> DynamicCache:
    """Prefill ``context_ids`` (batch, tokens) under ``press``; returns the compressed cache.

    Presses that read attention weights run with eager attention, restored afterwards.
    """
    cache = DynamicCache(config=model.config)
    previous = model.config._attn_implementation
    if name in EAGER_PRESSES:
        model.set_attn_implementation("eager")
    torch.manual_seed(seed)  # presses that sketch or sample draw from the global generator
    try:
        with press(model):
            model.get_decoder()(input_ids=context_ids, past_key_values=cache, use_cache=True)
    finally:
        if name in EAGER_PRESSES:
            model.set_attn_implementation(previous)
    return cache
