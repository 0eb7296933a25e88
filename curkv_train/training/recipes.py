"""Recipes: YAML configs for LightningCLI, named by file stem, shipped inside the package.

Every recipe is layered on ``_base.yaml`` (the one shared base layer): ``--recipe NAME``
(:class:`ActionRecipe`) applies ``_base.yaml`` then ``NAME.yaml`` as config files where it
stands on the command line, so later flags win.
"""

from __future__ import annotations

import argparse
import difflib
from importlib import resources
from pathlib import Path

import yaml
from jsonargparse import ActionConfigFile

from curkv_train.core.errors import CurKVError

BASE_LAYER = "_base"


def recipe_dir() -> Path:
    """Folder holding the recipe files (``recipes/`` in a checkout, package data when installed)."""
    return Path(str(resources.files("curkv_train._recipes")))


def list_recipes() -> list[str]:
    """Names of all recipes (file stems), sorted; the base layer is not a recipe."""
    return sorted(p.stem for p in recipe_dir().glob("*.yaml") if not p.stem.startswith("_"))


def recipe_path(name: str) -> Path:
    """Path of recipe ``name`` (a name or a path to a YAML file); unknown names list close matches."""
    candidate = Path(name)
    if candidate.suffix in {".yaml", ".yml"} and candidate.is_file():
        return candidate
    path = recipe_dir() / f"{name}.yaml"
    if name.startswith("_") or not path.is_file():
        close = difflib.get_close_matches(name, list_recipes(), n=3, cutoff=0.4)
        hint = f"did you mean {', '.join(close)}?" if close else f"known recipes: {', '.join(list_recipes())}"
        raise CurKVError(f"unknown recipe {name!r}; {hint}")
    return path


def load_recipe(path: Path) -> dict:
    """Parse a recipe file; malformed YAML or a non-mapping is a one-line CurKVError."""
    try:
        content = yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise CurKVError(f"recipe {path} is not valid YAML{where}: {getattr(error, 'problem', error)}") from None
    if not isinstance(content, dict):
        raise CurKVError(f"recipe {path} must be a mapping of trainer/model/data sections")
    return content


def recipe_layers(name: str) -> list[Path]:
    """The config files of recipe ``name``, in the order they apply: the base layer, then the recipe."""
    path = recipe_path(name)
    load_recipe(path)
    return [recipe_dir() / f"{BASE_LAYER}.yaml", path]


class ActionRecipe(argparse.Action):
    """``--recipe NAME``: apply ``_base.yaml`` then the recipe as config files, where the flag stands.

    Like ``--config``, what comes later on the command line wins over the recipe; nothing is
    stored under ``recipe`` itself (the resolved values are).
    """

    def __init__(self, option_strings: list[str], dest: str, **kwargs) -> None:
        kwargs.setdefault("help", "recipe name (see `curkv-train recipes`) or path to a YAML file, applied on top "
                                  "of recipes/_base.yaml; later flags win")
        super().__init__(option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, metavar="NAME", **kwargs)

    def __call__(self, parser, namespace, value: str, option_string: str | None = None) -> None:
        for path in recipe_layers(value):
            ActionConfigFile.apply_config(parser, namespace, "config", str(path))


def print_recipes() -> None:
    """List the recipes (file stems in recipes/) with the file each one comes from."""
    for name in list_recipes():
        print(f"{name:16s} {recipe_path(name)}")
