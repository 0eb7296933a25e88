"""Recipes: YAML configs for LightningCLI, named by file stem, shipped inside the package.

Every recipe is layered on ``_base.yaml`` (the one shared base layer): the CLI
passes ``--config _base.yaml --config NAME.yaml`` before the user's own flags,
so later flags win.
"""

from __future__ import annotations

import difflib
from importlib import resources
from pathlib import Path

import yaml

from curkv_train.errors import CurKVError

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


def recipe_config_args(name: str) -> list[str]:
    """``--config`` arguments for recipe ``name`` on top of the base layer."""
    path = recipe_path(name)
    load_recipe(path)
    base = recipe_dir() / f"{BASE_LAYER}.yaml"
    return ["--config", str(base), "--config", str(path)]


def expand_recipe_flag(args: list[str]) -> list[str]:
    """Replace ``--recipe NAME`` / ``--recipe=NAME`` after the subcommand by its config files.

    The recipe's configs go right after the subcommand, so every other flag wins over it.
    """
    for index, arg in enumerate(args):
        if arg == "--recipe" or arg.startswith("--recipe="):
            name = arg.split("=", 1)[1] if "=" in arg else (args[index + 1] if index + 1 < len(args) else "")
            if not name:
                raise CurKVError("--recipe needs a name; run `curkv-train recipes` to list them")
            rest = args[:index] + args[index + (1 if "=" in arg else 2):]
            return rest[:1] + recipe_config_args(name) + rest[1:]
    return args
