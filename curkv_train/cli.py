"""``curkv-train``: one root parser for every subcommand.

LightningCLI builds the root parser (jsonargparse) and its subcommands:

- ``fit`` and ``validate``: LightningCLI's own (trainer, model and data options from their
  signatures), plus ``--recipe NAME`` (:class:`~curkv_train.training.recipes.ActionRecipe`) and the
  callbacks every run needs (``--checkpoint.*``, ``--throughput.*``, ``--loss_guard``,
  ``--output_guard.*``; a recipe sets them under the same keys);
- ``export``, ``eval``, ``compare``, ``calibrate``, ``plan`` and ``recipes``: the options of a function's signature and
  docstring (:data:`FUNCTION_COMMANDS`); the function runs instead of Lightning's classes.

Every ``--help`` is generated from those signatures. User errors (a :class:`CurKVError`, a
bad option) print one line ``curkv-train: error: ...`` and exit with status 2.
"""

from __future__ import annotations

import importlib
import logging
import sys
import warnings
from argparse import ArgumentError
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from jsonargparse import ArgumentParser
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ProgressBar, TQDMProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from curkv_train.core.errors import CurKVError
from curkv_train.training.recipes import ActionRecipe

if TYPE_CHECKING:
    from curkv_train.training.plan import Plan

PROG = "curkv-train"
DESCRIPTION = "Train, evaluate and ship the value estimator of value-guided KV-cache compression."

LIGHTNING_COMMANDS = {
    "fit": "Train a value estimator: --recipe NAME, then any flag (later flags win).",
    "validate": "Measure a trained checkpoint (--ckpt_path) on the held-out data of a recipe.",
}


@dataclass(frozen=True)
class FunctionCommand:
    """A subcommand whose options are a function's parameters, documented by its docstring.

    Attributes:
        options: ``module:function`` whose signature and docstring are the options (or ``module:Class``, a
            config dataclass: its fields and their docs).
        run: ``module:function`` called with the parsed options (default: ``options``); it
            prints what the user asked for.
    """

    options: str
    run: str | None = None

    def options_function(self) -> Callable:
        """The function whose signature is the options (imports its module)."""
        return _load(self.options)

    def run_function(self) -> Callable:
        """The function that runs the subcommand (imports its module)."""
        return _load(self.run or self.options)


FUNCTION_COMMANDS = {
    "export": FunctionCommand("curkv_train.training.export:export"),
    "eval": FunctionCommand("curkv_train.eval.cli:EvalConfig", run="curkv_train.eval.cli:main"),
    "compare": FunctionCommand("curkv_train.eval.compare:compare"),
    "calibrate": FunctionCommand("curkv_train.eval.calibrate:calibrate", run="curkv_train.eval.calibrate:main"),
    "plan": FunctionCommand("curkv_train.cli:plan_command"),
    "recipes": FunctionCommand("curkv_train.training.recipes:print_recipes"),
}


def _load(path: str) -> Callable:
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


def summary(function: Callable) -> str:
    """The first line of ``function``'s docstring."""
    return (function.__doc__ or "").strip().splitlines()[0]


def function_parser(function: Callable) -> ArgumentParser:
    """A subcommand parser with ``function``'s parameters as options (help from its docstring)."""
    parser = ArgumentParser(description=summary(function))
    parser.add_function_arguments(function, as_group=False)
    return parser


class CurKVCLI(LightningCLI):
    """LightningCLI with curkv-train's subcommands, ``--recipe`` and run-wide callbacks; the data
    module's tokenizer and protected spans are linked to the model's."""

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        """The Trainer methods that are subcommands (fit, validate) and the arguments they skip."""
        return {name: skip for name, skip in LightningCLI.subcommands().items() if name in LIGHTNING_COMMANDS}

    def _add_subcommands(self, parser: LightningArgumentParser, **kwargs) -> None:
        """Lightning's subcommands, then one parser per :data:`FUNCTION_COMMANDS` entry."""
        self._subcommand_parsers = {}
        subcommands = parser.add_subcommands()
        for name, description in LIGHTNING_COMMANDS.items():
            subparser = self._prepare_subcommand_parser(self.trainer_class, name,
                                                        **{"description": description, **kwargs.get(name, {})})
            self._subcommand_parsers[name] = subparser
            subcommands.add_subcommand(name, subparser, help=description)
        for name, command in FUNCTION_COMMANDS.items():
            function = command.options_function()
            subcommands.add_subcommand(name, function_parser(function), help=summary(function))

    def add_default_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        """``--recipe`` first (the run's starting point), then LightningCLI's ``--seed_everything``."""
        parser.add_argument("--recipe", action=ActionRecipe)
        super().add_default_arguments_to_parser(parser)

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        """The callbacks every run needs, each under its own key, and the model/data links."""
        from curkv_train.training.callbacks.checkpoint import LastStepCheckpoint
        from curkv_train.training.callbacks.guards import NonFiniteLossGuard, OutputSpaceGuard
        from curkv_train.training.callbacks.throughput import TokenThroughput

        for key, callback in (("checkpoint", LastStepCheckpoint), ("throughput", TokenThroughput),
                              ("loss_guard", NonFiniteLossGuard), ("output_guard", OutputSpaceGuard)):
            parser.add_lightning_class_args(callback, key)
        # Runs are counted in steps: files are named step=N.ckpt (an epoch is just a pass over train_size blocks).
        parser.set_defaults({"checkpoint.save_last": True, "checkpoint.every_n_train_steps": 50,
                             "checkpoint.filename": "{step}"})
        parser.link_arguments("model.base_model", "data.tokenizer")
        parser.link_arguments("model.base_fallback", "data.tokenizer_fallback")
        parser.link_arguments("model.n_sink", "data.n_sink")
        parser.link_arguments("model.window", "data.window")

    def parse_arguments(self, parser: LightningArgumentParser, args: list[str]) -> None:
        """Parse ``args`` into ``self.config``.

        ``main`` passes ``sys.argv[1:]`` itself, which LightningCLI would warn about (``args`` given
        while ``sys.argv`` holds arguments); that warning is meant for scripts that pass both.
        """
        self.config = parser.parse_args(args)

    def _set_seed(self) -> None:
        """Seed fit and validate only (a function command has no ``seed_everything``)."""
        if self.subcommand not in FUNCTION_COMMANDS:
            super()._set_seed()

    def instantiate_classes(self) -> None:
        """Model, data and trainer for fit and validate; a function command needs none."""
        if self.subcommand not in FUNCTION_COMMANDS:
            super().instantiate_classes()

    def instantiate_trainer(self, **kwargs) -> Trainer:
        """The trainer, with tqdm's progress bar unless the bar is off or one is given.

        Lightning 2.6's Rich bar shows a step-based run (``max_epochs`` -1) as ``Epoch 0/-2``;
        tqdm's shows ``Epoch 0`` and the steps.
        """
        config = self._get(self.config_init, "trainer", default={})
        callbacks = config.get("callbacks") or []
        callbacks = list(callbacks) if isinstance(callbacks, list) else [callbacks]
        if config.get("enable_progress_bar") is not False and not any(isinstance(c, ProgressBar) for c in callbacks):
            callbacks.append(TQDMProgressBar())
        return super().instantiate_trainer(**{"callbacks": callbacks, **kwargs})

    def _run_subcommand(self, subcommand: str) -> None:
        """Call a function command with its parsed options; run fit / validate as LightningCLI does."""
        if subcommand in FUNCTION_COMMANDS:
            FUNCTION_COMMANDS[subcommand].run_function()(**self.config[subcommand].as_dict())
        else:
            super()._run_subcommand(subcommand)

    def before_fit(self) -> None:
        """Check the output folders before Lightning creates any (a one-line error, not a traceback)."""
        from curkv_train.training.callbacks.guards import check_before_fit

        check_before_fit(self.trainer)
        self.resolve_last_checkpoint()

    def before_validate(self) -> None:
        self.resolve_last_checkpoint()

    def resolve_last_checkpoint(self) -> None:
        """``--ckpt_path last``: the newest earlier run's ``last.ckpt``, which Lightning would look for in the new run's
        empty folder (:func:`~curkv_train.training.callbacks.checkpoint.last_checkpoint_of_earlier_runs`)."""
        from lightning.pytorch.utilities import rank_zero_info

        from curkv_train.training.callbacks.checkpoint import last_checkpoint_of_earlier_runs

        config = self.config_init[self.subcommand]
        if config.get("ckpt_path") == "last" and (found := last_checkpoint_of_earlier_runs(self.trainer)):
            rank_zero_info(f"--ckpt_path last: {found}")
            config["ckpt_path"] = str(found)


def build_cli(args: list[str], run: bool = True) -> CurKVCLI:
    """The CLI over ``args``.

    ``run=True`` parses a subcommand and runs it. ``run=False`` parses ``fit``'s options and
    builds model, data and trainer without running (a leading ``fit`` is dropped).
    """
    from curkv_train.training.data.datamodule import CurKVDataModule
    from curkv_train.training.system import CurKVModule

    if not run and args[:1] == ["fit"]:
        args = args[1:]
    return CurKVCLI(CurKVModule, CurKVDataModule, args=args, run=run, save_config_kwargs={"overwrite": True},
                    parser_kwargs={"prog": PROG, "description": DESCRIPTION, "exit_on_error": False})


def parse_recipe(recipe: str, overrides: list[str] | None = None):
    """The recipe's resolved config (``--recipe``, then ``overrides``) through the real CLI parser.

    Nothing is instantiated: no model, no data, no trainer (so no GPU is needed).
    """
    from curkv_train.training.data.datamodule import CurKVDataModule
    from curkv_train.training.system import CurKVModule

    class ParseOnlyCLI(CurKVCLI):
        def instantiate_classes(self) -> None:
            """Parsing is all a plan needs."""

    seed_log = logging.getLogger("lightning.fabric.utilities.seed")
    level = seed_log.level
    seed_log.setLevel(logging.WARNING)
    try:
        return ParseOnlyCLI(CurKVModule, CurKVDataModule, args=["--recipe", recipe, *(overrides or [])],
                            run=False).config
    finally:
        seed_log.setLevel(level)


def plan_command(recipe: str, devices: int | None = None, num_nodes: int | None = None,
                 batch_size: int | None = None, json: bool = False) -> "Plan":
    """Size one training step of a recipe per GPU, without a GPU; print it as a table or JSON.

    Args:
        recipe: recipe name (see ``curkv-train recipes``) or a YAML path.
        devices: GPUs per node (default: the recipe's trainer.devices).
        num_nodes: nodes (default: the recipe's trainer.num_nodes).
        batch_size: blocks per GPU (default: the recipe's data.batch_size).
        json: print JSON instead of a table.
    """
    overrides = [f"--trainer.{name}={value}" for name, value in (("devices", devices), ("num_nodes", num_nodes))
                 if value is not None]
    if batch_size is not None:
        overrides.append(f"--data.batch_size={batch_size}")
    from curkv_train.training.plan import compute_plan, format_plan, plan_json

    plan = compute_plan(recipe, parse_recipe(recipe, overrides))
    print(plan_json(plan) if json else format_plan(plan))
    return plan


def _not_a_tip(record: logging.LogRecord) -> bool:
    return "💡 Tip:" not in record.getMessage()


def quiet_lightning() -> None:
    """Silence what Lightning prints that a curkv-train user cannot act on (each filter says why)."""
    # The frozen base is in eval mode on purpose (models.base.freeze): the teacher and student
    # passes run the LLM as inference does, without dropout.
    warnings.filterwarnings("ignore", message=r"Found \d+ module\(s\) in eval mode at the start of training")
    # Lightning 2.6's own pytree helper uses torch's deprecated LeafSpec; only Lightning can change it.
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                            category=FutureWarning)
    # Lightning's tips advertise its cloud services (litlogger, litmodels); they say nothing about the run.
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(_not_a_tip)


def main(argv: list[str] | None = None) -> int:
    """Entry point; user errors (ours, the parser's, Lightning's misconfigurations) print one line and exit with status 2."""
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    quiet_lightning()
    try:
        build_cli(list(sys.argv[1:] if argv is None else argv))
    except (CurKVError, ArgumentError, MisconfigurationException) as error:
        print(f"{PROG}: error: {' '.join(str(error).split())}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
