"""Every recipe on disk parses through the real CLI; the list comes from the folder, not by hand."""

import pytest
import yaml

from curkv_train.cli import build_cli
from curkv_train.recipes import list_recipes, recipe_dir
from recipe_flags import hardware_flags


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


@pytest.mark.parametrize("name", list_recipes())
def test_recipe_has_only_known_sections(name):
    content = yaml.safe_load((recipe_dir() / f"{name}.yaml").read_text())
    assert set(content) <= {"trainer", "model", "data", "seed_everything", "ckpt_path"}


def test_later_flags_win_over_the_recipe(tmp_path):
    cli = build_cli(["fit", "--recipe", "tiny-debug", "--model.keep_ratio=0.25",
                     f"--trainer.default_root_dir={tmp_path}"], run=False)
    assert cli.model.hparams.keep_ratio == 0.25
