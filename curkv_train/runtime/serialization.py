"""Scorer folders on disk: ``scorer.safetensors`` (weights) + ``scorer.json`` (everything else).

``scorer.json`` records the format version, the base model and a fingerprint of its
architecture, the estimator's constructor arguments, the settings it was trained
under (key view, sinks, window, temperature, keep ratio, allocation), the training recipe and
metrics, and the sha256 of the weights file. :func:`load_scorer` checks all of it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

from curkv_train.core.atomic import atomic_folder
from curkv_train.core.shapes import kv_shape, text_config
from curkv_train.core.errors import CurKVError
from curkv_train.models.base import load_base_model, load_tokenizer
from curkv_train.models.families import ESTIMATORS, check_family
from curkv_train.runtime.allocation import LayerBudget
from curkv_train.runtime.scorer import Scorer

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
WEIGHTS_FILE = "scorer.safetensors"
CONFIG_FILE = "scorer.json"
ROPE_FIELDS = ("rope_theta", "rope_scaling", "rope_parameters", "partial_rotary_factor")
SCORER_SETTINGS = ("key_view", "n_sink", "window", "temperature", "keep_ratio", "allocation", "head_floor")


def _jsonable(value: Any) -> Any:
    """``value`` with tensors, paths and other objects turned into JSON-safe values."""
    return json.loads(json.dumps(value, default=lambda v: v.tolist() if isinstance(v, torch.Tensor) else str(v)))


def model_fingerprint(config: PretrainedConfig) -> dict:
    """What a scorer depends on in a base model's config: shapes, RoPE settings, vocabulary, positions.

    Args:
        config: the base model's config (its text config is used for multimodal models).

    Returns:
        A JSON-safe dict; two models a scorer can serve have equal fingerprints.
    """
    text, shape = text_config(config), kv_shape(config)
    fingerprint = {
        "model_type": text.model_type,
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim,
        "hidden_size": shape.hidden_size,
        "vocab_size": text.vocab_size,
        "max_position_embeddings": shape.max_positions,
    }
    for name in ROPE_FIELDS:
        if getattr(text, name, None) is not None:
            fingerprint[name] = getattr(text, name)
    return _jsonable(fingerprint)


def fingerprint_differences(expected: dict, actual: dict) -> dict:
    """Fields whose values differ: {field: (expected, actual)} (a missing field counts as None)."""
    return {key: (expected.get(key), actual.get(key)) for key in sorted(set(expected) | set(actual))
            if expected.get(key) != actual.get(key)}


def file_sha256(path: Path) -> str:
    """Hex sha256 of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def scorer_record(scorer: Scorer, base_model: str | None = None, fingerprint: dict | None = None,
                  extra: dict | None = None) -> dict:
    """The ``scorer.json`` content for ``scorer`` (without the weights' sha256).

    The scorer's own metadata is the base; ``base_model``, ``fingerprint`` and ``extra``
    (e.g. ``{"training": ..., "metrics": ...}``) override it.
    """
    record = dict(scorer.metadata)
    base = dict(record.get("base_model") or {})
    if base_model is not None:
        base["id"] = base_model
    if fingerprint is not None:
        base["fingerprint"] = fingerprint
    record.update(extra or {})
    record.update({
        "format_version": FORMAT_VERSION,
        "base_model": base,
        "estimator": {"family": scorer.family, "class": type(scorer.estimator).__name__,
                      "config": scorer.estimator.config()},
        "settings": {name: getattr(scorer, name) for name in SCORER_SETTINGS},
    })
    if scorer.layer_budget is None:
        record.pop("layer_budget", None)
    else:  # how it was measured (``calibration``) stays beside the numbers
        record["layer_budget"] = {**(record.get("layer_budget") or {}), **scorer.layer_budget.record()}
    return _jsonable(record)


def save_scorer(scorer: Scorer, out_dir: str | os.PathLike, *, base_model: str | None = None,
                fingerprint: dict | None = None, extra: dict | None = None, overwrite: bool = False) -> Path:
    """Write ``scorer`` to ``out_dir`` as scorer.safetensors + scorer.json, atomically.

    Both files are written into a temporary folder beside ``out_dir`` that is then
    renamed into place (:func:`~curkv_train.core.atomic.atomic_folder`), so a reader never
    sees a half-written scorer.

    Args:
        scorer: the estimator and its settings.
        out_dir: the folder to create, e.g. ``checkpoints/NAME``.
        base_model, fingerprint, extra: see :func:`scorer_record`.
        overwrite: replace an existing ``out_dir``.

    Returns:
        ``out_dir`` as a Path.
    """
    out = Path(out_dir)
    if out.exists() and not overwrite:
        raise CurKVError(f"{out} already exists; pass overwrite (--overwrite true) or choose another folder")
    record = scorer_record(scorer, base_model, fingerprint, extra)
    with atomic_folder(out) as staging:
        weights = {name: tensor.detach().cpu().contiguous() for name, tensor in scorer.estimator.state_dict().items()}
        save_file(weights, staging / WEIGHTS_FILE, metadata={"format_version": str(FORMAT_VERSION)})
        record["weights"] = {"file": WEIGHTS_FILE, "sha256": file_sha256(staging / WEIGHTS_FILE)}
        (staging / CONFIG_FILE).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    return out


def resolve_scorer_dir(path: str | os.PathLike) -> Path:
    """The folder of a scorer: ``path`` itself, the folder of a ``scorer.json``, or a shipped checkpoint name."""
    candidate = Path(path)
    if candidate.is_file() and candidate.name == CONFIG_FILE:
        return candidate.parent
    if (candidate / CONFIG_FILE).is_file():
        return candidate
    shipped = Path(str(resources.files("curkv_train._checkpoints"))) / str(path)
    if (shipped / CONFIG_FILE).is_file():
        return shipped
    raise CurKVError(f"no {CONFIG_FILE} in {candidate}; pass a folder written by `curkv-train export`")


def load_scorer(path: str | os.PathLike, model: PreTrainedModel | None = None,
                device: str | torch.device = "cpu") -> Scorer:
    """Read a scorer folder back, checking format version, weights sha256 and (given ``model``) its fingerprint.

    Args:
        path: the folder (or its scorer.json, or the name of a checkpoint shipped with the package).
        model: the base model the scorer will serve; its config must match the recorded fingerprint.
        device: where to put the estimator.

    Returns:
        The Scorer, with the whole scorer.json as ``metadata``.
    """
    folder = resolve_scorer_dir(path)
    record = _read_record(folder / CONFIG_FILE)
    weights_path = _checked_weights(folder, record)
    entry = record.get("estimator")
    if not isinstance(entry, dict) or not isinstance(entry.get("config"), dict):
        raise CurKVError(f"{folder / CONFIG_FILE} has no estimator entry with a config (the constructor "
                         "arguments); re-export the scorer")
    estimator = _load_estimator(entry, weights_path).to(device).eval().requires_grad_(False)
    settings = record.get("settings", {})
    scorer = Scorer(estimator, metadata=record, layer_budget=_layer_budget(record, config_path=folder / CONFIG_FILE),
                    **{k: settings[k] for k in SCORER_SETTINGS if k in settings})
    if model is not None:
        check_scorer_fits(scorer, model)
    return scorer


def _checked_weights(folder: Path, record: dict) -> Path:
    """The weights file scorer.json names, present and with the sha256 it records; else a one-line error."""
    weights_path = folder / record.get("weights", {}).get("file", WEIGHTS_FILE)
    if not weights_path.is_file():
        raise CurKVError(f"weights file {weights_path} is missing; re-export the scorer")
    expected = record.get("weights", {}).get("sha256")
    actual = file_sha256(weights_path)
    if expected != actual:
        raise CurKVError(f"sha256 of {weights_path} is {actual}, scorer.json records {expected}: "
                         "the file is corrupt or was changed; re-export or re-download it")
    return weights_path


def _layer_budget(record: dict, config_path: Path) -> LayerBudget | None:
    """scorer.json's ``layer_budget`` (None without one); a one-line error for a malformed one."""
    entry = record.get("layer_budget")
    if entry is None:
        return None
    try:
        budget = LayerBudget.from_record(entry)
    except (KeyError, TypeError, ValueError) as error:
        raise CurKVError(f"{config_path}: malformed layer_budget ({type(error).__name__}: {error}); "
                         "re-run `curkv-train calibrate`") from None
    layers = record.get("estimator", {}).get("config", {}).get("num_layers")
    if layers is not None and budget.num_layers != layers:
        raise CurKVError(f"{config_path}: layer_budget covers {budget.num_layers} layers, the estimator {layers}")
    return budget


def record_family(entry: dict) -> str:
    """The estimator family a scorer.json ``estimator`` entry names; a one-line CurKVError without one."""
    if not entry.get("family"):
        raise CurKVError("scorer.json's estimator entry names no family (an export older than estimator families); "
                         "re-export the scorer with this curkv-train's `curkv-train export`")
    return check_family(entry["family"])


def _load_estimator(entry: dict, weights_path: Path):
    """The estimator a scorer.json ``estimator`` entry describes (built on the meta device: no RNG use),
    holding the saved weights."""
    cls = ESTIMATORS[record_family(entry)]
    try:
        with torch.device("meta"):
            estimator = cls(**entry["config"])
        estimator.load_state_dict(load_file(weights_path), strict=True, assign=True)
    except (RuntimeError, TypeError) as error:
        raise CurKVError(f"{weights_path} does not fit the estimator recorded in scorer.json "
                         f"({str(error).splitlines()[0]}); re-export the scorer") from None
    return estimator


def _read_record(config_path: Path) -> dict:
    """Parse scorer.json and check its format version."""
    try:
        record = json.loads(config_path.read_text())
    except json.JSONDecodeError as error:
        raise CurKVError(f"{config_path} is not valid JSON ({error.msg} at line {error.lineno})") from None
    version = record.get("format_version") if isinstance(record, dict) else None
    if version != FORMAT_VERSION:
        raise CurKVError(f"{config_path} has scorer format version {version!r}; this curkv-train reads "
                         f"version {FORMAT_VERSION}: re-export it with this version's `curkv-train export`")
    return record


def check_scorer_fits(scorer: Scorer, model: PreTrainedModel) -> None:
    """Raise a CurKVError naming the differing fields if ``model`` is not the one ``scorer`` was trained on."""
    actual = model_fingerprint(model.config)
    expected = (scorer.metadata.get("base_model") or {}).get("fingerprint")
    if expected is None:
        log.warning("scorer records no base-model fingerprint; checking shapes only")
        config = scorer.estimator.config()
        expected = {"num_hidden_layers": config["num_layers"], "num_key_value_heads": config["num_kv_heads"],
                    "head_dim": config["head_dim"]}
        actual = {key: actual[key] for key in expected}
    differences = fingerprint_differences(expected, actual)
    if differences:
        listed = "; ".join(f"{key}: scorer {want!r} vs model {got!r}" for key, (want, got) in differences.items())
        base = (scorer.metadata.get("base_model") or {}).get("id", "its base model")
        raise CurKVError(f"scorer was trained for {base}, not this model ({listed}); "
                         "use the base model it was trained on or train a scorer for this one")


def load_base_for(scorer: Scorer | str | os.PathLike,
                  dtype: torch.dtype = torch.float32) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The base model (frozen, ``attn_implementation="sdpa"``) and tokenizer ``scorer`` was trained for.

    Args:
        scorer: a :class:`Scorer`, an exported scorer folder or a shipped scorer's name (``"smollm2-135m"``).
        dtype: the model's weights' dtype.

    Returns:
        (model, tokenizer): the scorer's recorded hub id when the hub (or the local Hugging Face cache) has it,
        else the fallback its training recorded (e.g. ``embedded:smollm2-135m-instruct``); the model is checked
        against the scorer's fingerprint.
    """
    if not isinstance(scorer, Scorer):
        scorer = load_scorer(scorer)
    base, fallback = scorer.base_model_id, scorer.base_fallback
    if base is None:
        raise CurKVError("the scorer records no base model; load one with "
                         "curkv_train.models.base.load_base_model(NAME_OR_PATH, attn_implementation='sdpa')")
    model = load_base_model(base, fallback=fallback, dtype=dtype, attn_implementation="sdpa")
    check_scorer_fits(scorer, model)
    return model, load_tokenizer(base, fallback=fallback)
