"""``curkv-train export``: turn a training checkpoint into a runtime scorer folder.

    curkv-train export --ckpt runs/.../checkpoints/last.ckpt --out checkpoints/NAME

writes ``NAME/scorer.safetensors`` and ``NAME/scorer.json`` (see
:mod:`curkv_train.runtime.serialization`), recording the base model's fingerprint,
the estimator's architecture and settings, the run's resolved config and the
metrics its logs hold.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import yaml
from torch import nn
from transformers import AutoConfig, PretrainedConfig

from curkv_train.core.shapes import kv_shape
from curkv_train.core.errors import CurKVError
from curkv_train.models.base import TINY_MODELS, resolve_model_source
from curkv_train.models.families import build_estimator
from curkv_train.runtime.allocation import LayerBudget
from curkv_train.runtime.scorer import Scorer
from curkv_train.runtime.serialization import model_fingerprint, save_scorer
from curkv_train.training.system import LAYER_BUDGET_KEY, SETTINGS_KEY

log = logging.getLogger(__name__)

ESTIMATOR_PREFIX = "estimator."


def read_checkpoint(path: Path) -> dict:
    """The Lightning checkpoint at ``path``, on CPU; a missing or unreadable file is a CurKVError."""
    if path.is_dir():
        raise CurKVError(f"checkpoint {path} is a folder (an FSDP sharded checkpoint?): consolidate it first with "
                         f"`python -m lightning.pytorch.utilities.consolidate_checkpoint {path}` and export the "
                         "consolidated file (docs/scale-out.md)")
    if not path.is_file():
        raise CurKVError(f"checkpoint {path} does not exist; pass the .ckpt of a `curkv-train fit` run")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # torch raises several types for a file that is not a checkpoint
        raise CurKVError(f"cannot read checkpoint {path}: {str(error).splitlines()[0]}") from None
    if "state_dict" not in checkpoint or "hyper_parameters" not in checkpoint:
        raise CurKVError(f"{path} is not a curkv-train checkpoint (no state_dict / hyper_parameters)")
    return checkpoint


def base_config(name: str, fallback: str | None = None) -> PretrainedConfig:
    """The base model's config by hub id, local folder, ``embedded:NAME`` or a tiny random model's name."""
    source = resolve_model_source(name, fallback)
    if source in TINY_MODELS:
        return TINY_MODELS[source]()
    return AutoConfig.from_pretrained(source)


def restore_estimator(checkpoint: dict, config: PretrainedConfig) -> nn.Module:
    """The checkpoint's estimator, shaped for ``config`` as CurKVModule.configure_model builds it."""
    hp = checkpoint["hyper_parameters"]
    estimator = build_estimator(hp.get("estimator", "seed"), kv_shape(config), **(hp.get("estimator_options") or {}))
    state = {key.removeprefix(ESTIMATOR_PREFIX): value for key, value in checkpoint["state_dict"].items()
             if key.startswith(ESTIMATOR_PREFIX)}
    if not state:
        raise CurKVError("the checkpoint holds no estimator.* weights; was it written by `curkv-train fit`?")
    expected = {name: tuple(tensor.shape) for name, tensor in estimator.state_dict().items()}
    found = {name: tuple(tensor.shape) for name, tensor in state.items()}
    if expected != found:
        raise CurKVError(f"checkpoint estimator shapes {found} do not match base model "
                         f"{hp.get('base_model')!r} ({expected}); pass --base_model with the model it was trained on")
    estimator.load_state_dict(state)
    return estimator.eval().requires_grad_(False)


def run_dir(ckpt: Path) -> Path:
    """The run's version folder: the parent of ``checkpoints/`` when the ckpt sits in one."""
    return ckpt.parent.parent if ckpt.parent.name == "checkpoints" else ckpt.parent


def run_config(ckpt: Path) -> tuple[dict | None, str | None]:
    """The resolved config LightningCLI saved for the run (config.yaml beside the version folder), and its path."""
    for folder in (run_dir(ckpt), ckpt.parent):
        path = folder / "config.yaml"
        if path.is_file():
            return yaml.safe_load(path.read_text()), str(path)
    log.warning("no config.yaml found near %s; the export records hyper-parameters only", ckpt)
    return None, None


def _number(value) -> float | None:
    """A plain float for a tensor or number, None otherwise."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value)
    return float(value) if isinstance(value, (int, float)) else None


def checkpoint_metrics(checkpoint: dict) -> dict:
    """ModelCheckpoint scores recorded in the checkpoint's callback states."""
    found = {}
    for name, state in (checkpoint.get("callbacks") or {}).items():
        if isinstance(state, dict) and "best_model_score" in state:
            found[name] = {"monitor": state.get("monitor"), "best_model_score": _number(state.get("best_model_score")),
                           "current_score": _number(state.get("current_score")),
                           "best_model_path": state.get("best_model_path")}
    return found


def logged_metrics(folder: Path, up_to_step: int | None = None) -> dict:
    """Last value and step of every scalar in the run's TensorBoard event files ({} without any), among those of
    the first ``up_to_step`` steps (a checkpoint's global_step: a run goes on past the checkpoint exported).

    Lightning logs the k-th optimizer step's metrics, and a validation run after it, at TensorBoard step k − 1,
    so those are the events before step ``up_to_step``."""
    if not any(folder.glob("events.out.tfevents.*")):
        return {}
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError:
        log.warning("tensorboard is not installed; the export records no logged metrics")
        return {}
    events = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    events.Reload()
    last = {}
    for tag in events.Tags().get("scalars", []):
        logged = [event for event in events.Scalars(tag) if up_to_step is None or event.step < up_to_step]
        if logged:
            last[tag] = {"step": logged[-1].step, "value": logged[-1].value}
    return last


def run_metrics(ckpt: Path, checkpoint: dict) -> dict:
    """Training and validation metrics: logged scalars split by prefix, plus checkpoint callback scores."""
    logged = logged_metrics(run_dir(ckpt), checkpoint.get("global_step"))
    return {
        "training": {tag: value for tag, value in logged.items() if tag.startswith("train")},
        "validation": {tag: value for tag, value in logged.items() if tag.startswith("val")},
        "other": {tag: value for tag, value in logged.items() if not tag.startswith(("train", "val"))},
        "checkpoint_callbacks": checkpoint_metrics(checkpoint),
        "source": str(run_dir(ckpt)) if logged else None,
    }


def training_record(ckpt: Path, checkpoint: dict) -> dict:
    """What the run was: hyper-parameters, data settings, resolved config, progress."""
    config, config_path = run_config(ckpt)
    clean = lambda hp: {k: v for k, v in (hp or {}).items() if not k.startswith("_")}  # noqa: E731
    return {
        "checkpoint": str(ckpt),
        "hyper_parameters": clean(checkpoint["hyper_parameters"]),
        "datamodule_hyper_parameters": clean(checkpoint.get("datamodule_hyper_parameters")),
        "config": config,
        "config_file": config_path,
        "global_step": checkpoint.get("global_step"),
        "epoch": checkpoint.get("epoch"),
        "lightning_version": checkpoint.get("pytorch-lightning_version"),
        "last_step_settings": checkpoint.get(SETTINGS_KEY),
        "last_stage": last_stage(checkpoint),
    }


def last_stage(checkpoint: dict) -> dict | None:
    """The settings of the curriculum stage the run ended in, with what it inherits from earlier stages (e.g.
    a list of ratios or a range)."""
    for state in (checkpoint.get("callbacks") or {}).values():
        if isinstance(state, dict) and state.get("stages") and state.get("stage_index", -1) >= 0:
            return state["stage_settings"]
    return None


def export(ckpt: Path, out: Path, base_model: str | None = None, overwrite: bool = False) -> Path:
    """Export a training checkpoint as a runtime scorer folder (scorer.safetensors + scorer.json).

    Args:
        ckpt: Lightning checkpoint of a `curkv-train fit` run, e.g. runs/NAME/lightning_logs/version_0/checkpoints/last.ckpt.
        out: folder to write, e.g. checkpoints/NAME.
        base_model: read the base model's config from here (hub id or local folder) instead of the
            checkpoint's base_model, e.g. when the hub is unreachable.
        overwrite: replace an existing output folder.

    Returns:
        The folder written.
    """
    ckpt, out = Path(ckpt), Path(out)
    checkpoint = read_checkpoint(ckpt)
    hp = checkpoint["hyper_parameters"]
    model_id = hp.get("base_model")
    config = base_config(base_model or model_id, None if base_model else hp.get("base_fallback"))
    last_step = {**{"keep_ratio": hp.get("keep_ratio", 0.5), "temperature": hp.get("temperature", 1.0)},
                 **(checkpoint.get(SETTINGS_KEY) or {})}
    stage = last_stage(checkpoint) or {}
    if stage.get("compression_range"):  # one ratio drawn per step: the last draw says nothing, the range's middle does
        last_step["keep_ratio"] = 1.0 - sum(stage["compression_range"]) / 2
    elif isinstance(stage.get("keep_ratio"), list):  # cycled per step: likewise, the middle of the list
        last_step["keep_ratio"] = sum(stage["keep_ratio"]) / len(stage["keep_ratio"])
    budget = checkpoint.get(LAYER_BUDGET_KEY)  # trained under a layer budget: the scorer runs with it
    scorer = Scorer(restore_estimator(checkpoint, config), key_view=hp.get("key_view", "pre_rope"),
                    n_sink=hp.get("n_sink", 4), window=hp.get("window", 64),
                    keep_ratio=last_step["keep_ratio"], temperature=last_step["temperature"],
                    allocation=stage.get("allocation", hp.get("allocation", "per_head")),
                    head_floor=stage.get("head_floor", hp.get("head_floor", 0.1)),
                    layer_budget=None if budget is None else LayerBudget.from_record(budget))
    extra = {"name": out.name, "training": training_record(ckpt, checkpoint), "metrics": run_metrics(ckpt, checkpoint)}
    if budget is not None:
        extra["layer_budget"] = budget
    written = save_scorer(scorer, out, base_model=model_id, fingerprint=model_fingerprint(config), extra=extra,
                          overwrite=overwrite)
    print(f"exported {ckpt} -> {written}")
    return written
