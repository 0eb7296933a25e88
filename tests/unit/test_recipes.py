"""Every recipe on disk parses through the real CLI; the list comes from the folder, not by hand."""

import pytest
import yaml

from curkv_train.training.callbacks.checkpoint import LastStepCheckpoint
from curkv_train.training.callbacks.guards import NonFiniteLossGuard, OutputSpaceGuard
from curkv_train.training.callbacks.throughput import TokenThroughput
from curkv_train.cli import build_cli
from curkv_train.cli import parse_recipe
from curkv_train.training.recipes import list_recipes, recipe_dir
from recipe_flags import hardware_flags

RUN_CALLBACKS = {"checkpoint", "throughput", "loss_guard", "output_guard"}  # keys the CLI registers


def test_recipes_are_found_by_globbing():
    on_disk = sorted(p.stem for p in recipe_dir().glob("*.yaml") if not p.stem.startswith("_"))
    assert list_recipes() == on_disk
    assert {"tiny-debug", "smollm2-135m"} <= set(on_disk)


@pytest.mark.parametrize("name", list_recipes())
def test_recipe_parses_through_lightning_cli(name, tmp_path):
    cli = build_cli(["fit", "--recipe", name, f"--trainer.default_root_dir={tmp_path}", *hardware_flags()], run=False)
    assert cli.model.hparams.base_model
    assert cli.datamodule.context_length > cli.model.hparams.n_sink + cli.model.hparams.window
    assert cli.datamodule.tokenizer_name == cli.model.hparams.base_model  # linked
    kinds = [type(callback) for callback in cli.trainer.callbacks]
    for kind in (LastStepCheckpoint, TokenThroughput, NonFiniteLossGuard, OutputSpaceGuard):  # registered by the CLI
        assert kinds.count(kind) == 1, (kind, kinds)
    assert cli.trainer.checkpoint_callback.save_last


@pytest.mark.parametrize("name", list_recipes())
def test_recipe_has_only_known_sections(name):
    content = yaml.safe_load((recipe_dir() / f"{name}.yaml").read_text())
    assert set(content) <= {"trainer", "model", "data", "seed_everything", "ckpt_path", *RUN_CALLBACKS}
    own = content.get("trainer", {}).get("callbacks") or []  # the run callbacks are the CLI's, not repeated here
    assert all(callback["class_path"].endswith(".Curriculum") for callback in own)


def test_later_flags_win_over_the_recipe(tmp_path):
    cli = build_cli(["fit", "--recipe", "tiny-debug", "--model.keep_ratio=0.25",
                     f"--trainer.default_root_dir={tmp_path}"], run=False)
    assert cli.model.hparams.keep_ratio == 0.25


def test_the_recipe_wins_over_earlier_flags(tmp_path):
    """``--recipe`` applies its files where it stands: a flag before it is overridden, one after it wins."""
    cli = build_cli(["fit", "--trainer.max_steps=7", "--checkpoint.every_n_train_steps=3", "--recipe", "tiny-debug",
                     "--trainer.log_every_n_steps=2", f"--trainer.default_root_dir={tmp_path}"], run=False)
    assert cli.trainer.max_steps == 4 and cli.trainer.log_every_n_steps == 2  # tiny-debug's 4, then the flag's 2
    assert cli.config.checkpoint.every_n_train_steps == 3  # the recipe does not set it


def test_a_recipe_configures_the_run_callbacks_under_their_keys():
    config = parse_recipe("llama2-70b")
    assert (config.checkpoint.save_last, config.checkpoint.every_n_train_steps) == ("link", 250)
    assert config.output_guard.min_free_gb == 300
    assert config.throughput.window_size == 20  # the CLI's default
