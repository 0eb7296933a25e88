"""Export a training checkpoint and load it back: bit-exact weights, sha256, format version, fingerprint."""

import json
import os
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from curkv_train.cli import main as cli_main
from curkv_train.core.errors import CurKVError
from curkv_train.training.export import export
from curkv_train.models.base import TINY_RANDOM, load_base_model, tiny_llama_config
from curkv_train.runtime import CurKVCache, load_scorer, model_fingerprint, save_scorer
from curkv_train.runtime.serialization import CONFIG_FILE, WEIGHTS_FILE
from runtime_helpers import TORCH


@pytest.fixture(scope="module")
def module():
    from curkv_train.training.system import CurKVModule

    module = CurKVModule(base_model=TINY_RANDOM, window=16, keep_ratio=0.4, temperature=0.5)
    module.configure_model()
    torch.manual_seed(1)
    with torch.no_grad():
        for parameter in module.estimator.parameters():
            parameter.normal_()
    return module


@pytest.fixture(scope="module")
def checkpoint_path(module, tmp_path_factory):
    """A checkpoint shaped like Lightning's: only estimator./budget. weights, plus hyper-parameters."""
    folder = tmp_path_factory.mktemp("run") / "lightning_logs" / "version_0"
    (folder / "checkpoints").mkdir(parents=True)
    (folder / "config.yaml").write_text("model:\n  base_model: tiny-random-llama\n  window: 16\n")
    state = {k: v for k, v in module.state_dict().items() if k.startswith(("estimator.", "budget."))}
    checkpoint = {"state_dict": state, "hyper_parameters": dict(module.hparams), "global_step": 7, "epoch": 0,
                  "datamodule_hyper_parameters": {"context_length": 96},
                  "callbacks": {"ModelCheckpoint{}": {"monitor": "val/kl_hard", "best_model_score": torch.tensor(0.25),
                                                      "current_score": torch.tensor(0.3), "best_model_path": "x"}}}
    path = folder / "checkpoints" / "last.ckpt"
    torch.save(checkpoint, path)
    return path


@pytest.fixture
def exported(checkpoint_path, tmp_path):
    return export(checkpoint_path, tmp_path / "tiny-scorer")


@pytest.fixture(scope="module")
def model():
    return load_base_model(TINY_RANDOM)


def test_round_trip_is_bit_exact(module, exported, model):
    scorer = load_scorer(exported, model=model)
    loaded = dict(scorer.estimator.named_parameters())
    for name, parameter in module.estimator.named_parameters():
        assert torch.equal(loaded[name], parameter), name
    assert (scorer.key_view, scorer.n_sink, scorer.window) == ("pre_rope", 4, 16)
    assert (scorer.keep_ratio, scorer.temperature) == (0.4, 0.5)


def test_record_holds_fingerprint_recipe_and_metrics(exported, model):
    record = json.loads((exported / CONFIG_FILE).read_text())
    assert record["format_version"] == 1
    assert record["base_model"]["id"] == TINY_RANDOM
    assert record["base_model"]["fingerprint"] == model_fingerprint(model.config)
    assert record["estimator"]["config"]["num_kv_heads"] == 2
    assert record["training"]["hyper_parameters"]["keep_ratio"] == 0.4
    assert record["training"]["datamodule_hyper_parameters"] == {"context_length": 96}
    assert record["training"]["config"]["model"]["window"] == 16
    assert record["training"]["global_step"] == 7
    callbacks = record["metrics"]["checkpoint_callbacks"]["ModelCheckpoint{}"]
    assert callbacks["best_model_score"] == 0.25 and callbacks["monitor"] == "val/kl_hard"
    assert len(record["weights"]["sha256"]) == 64
    assert sorted(os.listdir(exported.parent)) == ["tiny-scorer"]  # no temporary folders left


def test_fingerprint_records_rope_settings(model):
    fingerprint = model_fingerprint(model.config)
    assert fingerprint["num_key_value_heads"] == 2 and fingerprint["head_dim"] == 16
    assert fingerprint["rope_parameters"]["rope_theta"] == 10000.0
    assert fingerprint["max_position_embeddings"] == 2048 and fingerprint["vocab_size"] == 512


def test_corrupted_weights_name_the_file(exported):
    path = exported / WEIGHTS_FILE
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CurKVError, match=f"sha256 of .*{WEIGHTS_FILE}"):
        load_scorer(exported)


def test_wrong_model_names_differing_fields(exported):
    config = tiny_llama_config()
    config.max_position_embeddings = 4096
    config.rope_parameters = {"rope_type": "default", "rope_theta": 500000.0}
    other = LlamaForCausalLM(config)
    with pytest.raises(CurKVError, match="max_position_embeddings: scorer 2048 vs model 4096") as error:
        load_scorer(exported, model=other)
    assert "rope_parameters" in str(error.value)


def test_unsupported_format_version(exported):
    path = exported / CONFIG_FILE
    record = json.loads(path.read_text())
    record["format_version"] = 99
    path.write_text(json.dumps(record))
    with pytest.raises(CurKVError, match="format version 99"):
        load_scorer(exported)


@pytest.mark.parametrize("damage", ["no estimator", "no config", "config not a mapping"])
def test_a_malformed_estimator_entry_is_one_clear_error(exported, damage):
    path = exported / CONFIG_FILE
    record = json.loads(path.read_text())
    if damage == "no estimator":
        del record["estimator"]
    elif damage == "no config":
        del record["estimator"]["config"]
    else:
        record["estimator"]["config"] = [1, 2]
    path.write_text(json.dumps(record))
    with pytest.raises(CurKVError, match="estimator"):
        load_scorer(exported)


def test_missing_folder_and_existing_output(exported, checkpoint_path, tmp_path):
    with pytest.raises(CurKVError, match="no scorer.json"):
        load_scorer(tmp_path / "nothing")
    with pytest.raises(CurKVError, match="already exists"):
        export(checkpoint_path, exported)
    assert export(checkpoint_path, exported, overwrite=True) == exported


def test_save_scorer_round_trips_a_loaded_scorer(exported, tmp_path, model):
    scorer = load_scorer(exported)
    again = save_scorer(scorer, tmp_path / "copy")
    reloaded = load_scorer(again, model=model)
    assert reloaded.metadata["base_model"] == scorer.metadata["base_model"]
    assert reloaded.metadata["training"] == scorer.metadata["training"]
    assert reloaded.metadata["weights"]["sha256"] == scorer.metadata["weights"]["sha256"]


def test_cli_export_and_cache_from_folder(checkpoint_path, tmp_path, model):
    out = tmp_path / "cli-scorer"
    assert cli_main(["export", "--ckpt", str(checkpoint_path), "--out", str(out)]) == 0
    assert cli_main(["export", "--ckpt", str(tmp_path / "missing.ckpt"), "--out", str(tmp_path / "x")]) == 2
    cache = CurKVCache(out, model=model, keep_ratio=0.5, compute=TORCH)
    ids = torch.randint(3, 512, (1, 80))
    tokens = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
                            past_key_values=cache, pad_token_id=0)
    assert tokens.shape == (1, 84) and cache.held_tokens(0) < 83


def test_runtime_imports_without_kvpress():
    import subprocess
    import sys

    code = ("import sys; sys.modules['kvpress'] = None\n"
            "import curkv_train.runtime as runtime\n"
            "assert runtime.CurKVCache and runtime.load_scorer and runtime.save_scorer and runtime.Scorer\n"
            "try:\n    runtime.CurKVPress\nexcept ImportError as error:\n    print(error)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "CurKVPress needs kvpress" in result.stdout


@pytest.mark.parametrize("family", ["query_aware", "hidden"])
def test_export_records_the_family_and_the_last_stage_settings(family, tmp_path, model):
    """scorer.json holds the family and what the last stage used (T; ρ: the middle of its cycled list), not the
    hyper-parameters' defaults."""
    from dataclasses import asdict

    from curkv_train.training.objective import TrainingSettings
    from curkv_train.training.system import SETTINGS_KEY, CurKVModule

    module = CurKVModule(base_model=TINY_RANDOM, window=16, estimator=family, keep_ratio=0.5, temperature=1.0)
    module.configure_model()
    last = TrainingSettings(keep_ratio=0.3, temperature=0.5, hard_topk=True)
    state = {k: v for k, v in module.state_dict().items() if k.startswith(("estimator.", "budget."))}
    stages = [{"steps": 4, "keep_ratio": [0.5, 0.3], "temperature": 0.5, "hard_topk": True}]
    checkpoint = {"state_dict": state, "hyper_parameters": dict(module.hparams), "global_step": 4,
                  SETTINGS_KEY: asdict(last), "callbacks": {"Curriculum": {"stages": stages, "stage_index": 0, "stage_settings": stages[0]}}}
    torch.save(checkpoint, tmp_path / "last.ckpt")
    folder = export(tmp_path / "last.ckpt", tmp_path / "scorer")
    record = json.loads((folder / CONFIG_FILE).read_text())
    assert record["estimator"]["family"] == family
    assert record["settings"]["temperature"] == 0.5 and record["settings"]["keep_ratio"] == pytest.approx(0.4)
    assert record["training"]["last_stage"] == stages[0]
    scorer = load_scorer(folder, model=model)
    assert scorer.family == family
    for name, tensor in module.estimator.state_dict().items():
        assert torch.equal(scorer.estimator.state_dict()[name], tensor)


def test_a_sampled_last_stage_records_the_middle_of_its_keep_ratios(tmp_path):
    from dataclasses import asdict

    from curkv_train.training.objective import TrainingSettings
    from curkv_train.training.system import SETTINGS_KEY, CurKVModule

    module = CurKVModule(base_model=TINY_RANDOM, window=16, keep_ratio=0.5)
    module.configure_model()
    state = {k: v for k, v in module.state_dict().items() if k.startswith(("estimator.", "budget."))}
    stages = [{"steps": 4, "compression_range": [0.3, 0.8], "hard_topk": True}]
    checkpoint = {"state_dict": state, "hyper_parameters": dict(module.hparams), "global_step": 4,
                  SETTINGS_KEY: asdict(TrainingSettings(keep_ratio=0.6672, hard_topk=True)),
                  "callbacks": {"Curriculum": {"stages": stages, "stage_index": 0, "stage_settings": stages[0]}}}
    torch.save(checkpoint, tmp_path / "last.ckpt")
    record = json.loads((export(tmp_path / "last.ckpt", tmp_path / "scorer") / CONFIG_FILE).read_text())
    assert record["settings"]["keep_ratio"] == pytest.approx(0.45)
    assert record["training"]["last_stage"]["compression_range"] == [0.3, 0.8]


def test_a_last_stage_inheriting_a_range_records_its_middle(tmp_path):
    """The last stage sets neither keep_ratio nor compression_range: it draws from the earlier stage's range."""
    from curkv_train.training.callbacks.curriculum import Curriculum, Stage
    from curkv_train.training.system import SETTINGS_KEY, CurKVModule

    module = CurKVModule(base_model=TINY_RANDOM, window=16, keep_ratio=0.5)
    module.configure_model()
    curriculum = Curriculum([Stage(steps=2, compression_range=[0.3, 0.8]), Stage(steps=2, streaming_rounds=2)])
    curriculum.stage_index = 1
    state = {k: v for k, v in module.state_dict().items() if k.startswith(("estimator.", "budget."))}
    checkpoint = {"state_dict": state, "hyper_parameters": dict(module.hparams), "global_step": 4,
                  SETTINGS_KEY: {"keep_ratio": 0.6672, "temperature": 1.0},
                  "callbacks": {"Curriculum": curriculum.state_dict()}}
    torch.save(checkpoint, tmp_path / "last.ckpt")
    record = json.loads((export(tmp_path / "last.ckpt", tmp_path / "scorer") / CONFIG_FILE).read_text())
    assert record["settings"]["keep_ratio"] == pytest.approx(0.45)
    assert record["training"]["last_stage"]["compression_range"] == [0.3, 0.8]
    assert record["training"]["last_stage"]["streaming_rounds"] == 2


def test_logged_metrics_stop_at_the_checkpoints_step(tmp_path):
    """An earlier checkpoint of a run that went on records the metrics of its own steps, not later ones.

    Lightning logs the k-th step's metrics, and a validation run after it, at TensorBoard step k - 1, so a
    checkpoint at global_step k holds those logged before step k."""
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from curkv_train.training.export import logged_metrics

    class Counting(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(1))

        def training_step(self, batch, index):
            self.log("train/nth_step", float(self.global_step + 1))
            return self.weight.square().sum()

        def validation_step(self, batch, index):
            self.log("val/after_steps", float(self.global_step))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    loader = DataLoader(TensorDataset(torch.zeros(8, 1)), batch_size=1)
    trainer = L.Trainer(max_steps=5, default_root_dir=tmp_path, log_every_n_steps=1, val_check_interval=2,
                        limit_val_batches=1, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False, accelerator="cpu")
    trainer.fit(Counting(), loader, loader)
    folder = Path(trainer.logger.log_dir)
    at_two = logged_metrics(folder, up_to_step=2)
    assert at_two["train/nth_step"]["value"] == 2.0 and at_two["val/after_steps"]["value"] == 2.0
    assert logged_metrics(folder, up_to_step=3)["train/nth_step"]["value"] == 3.0
    assert logged_metrics(folder)["train/nth_step"]["value"] == 5.0
