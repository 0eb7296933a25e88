"""Architecture configs without weights: from the hub when reachable, else shipped with the package.

The configs of the bases the recipes and benchmarks name (Llama-2-7B, Llama-2-70B, and
the hub originals of the embedded SmolLM2-135M-Instruct and Gemma 3 270M) ship
under ``data/model_configs/`` (package ``curkv_train._data``), one JSON file per
hub id with ``/`` written as ``--``. They are what ``curkv-train plan`` and the
meta-device tests read on a machine with no hub access, or without access to the
gated Llama-2 repositories.
"""

from __future__ import annotations

import logging
from importlib import resources
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from curkv_train.core.shapes import KVShape, kv_shape  # noqa: F401  (re-exported for plan)
from curkv_train.core.errors import CurKVError
from curkv_train.models.base import TINY_MODELS, freeze, hub_reachable, resolve_model_source

log = logging.getLogger(__name__)

SHIPPED_FOLDER = "model_configs"


def shipped_config_dir() -> Path:
    """Folder of the shipped model configs (``data/model_configs`` in a checkout)."""
    return Path(str(resources.files("curkv_train._data"))) / SHIPPED_FOLDER


def shipped_config_path(model_id: str) -> Path:
    """Where the shipped config of hub id ``model_id`` lives (it may not exist)."""
    return shipped_config_dir() / f"{model_id.replace('/', '--')}.json"


def shipped_model_ids() -> list[str]:
    """Hub ids that have a shipped config, sorted."""
    return sorted(path.stem.replace("--", "/") for path in shipped_config_dir().glob("*.json"))


def load_model_config(name_or_path: str) -> PretrainedConfig:
    """The architecture config of a base model, never its weights.

    Local folders, ``embedded:NAME`` and the tiny random models' names resolve as in
    :func:`~curkv_train.models.base.load_base_model`. A hub id is read from the hub
    (or the local Hugging Face cache) when that works, else from the shipped copy.

    Raises:
        CurKVError: the config is neither reachable nor shipped.
    """
    if name_or_path in TINY_MODELS:
        return TINY_MODELS[name_or_path]()
    if name_or_path.startswith(("embedded:", ".", "/", "~")) or Path(name_or_path).is_dir():
        return AutoConfig.from_pretrained(resolve_model_source(name_or_path))
    try:
        return AutoConfig.from_pretrained(name_or_path, local_files_only=not hub_reachable())
    except Exception as error:  # offline, gated (Llama-2) or unknown: try the shipped copy
        reason = f"{type(error).__name__}"
    shipped = shipped_config_path(name_or_path)
    if not shipped.is_file():
        raise CurKVError(f"no config for model {name_or_path!r}: the hub gave {reason} and none is shipped "
                         f"(shipped: {', '.join(shipped_model_ids())}); pass a local model folder")
    log.info("using the shipped config of %s (%s)", name_or_path, reason)
    return AutoConfig.from_pretrained(str(shipped))


def build_meta_model(config: PretrainedConfig, dtype: torch.dtype = torch.bfloat16) -> PreTrainedModel:
    """The causal LM of ``config`` on the meta device: every shape, no memory, frozen.

    Used to count parameters and bytes (``curkv-train plan``) and, under FSDP, as the
    empty skeleton on ranks that do not read the weights (rank 0's are broadcast).
    """
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return freeze(model)
