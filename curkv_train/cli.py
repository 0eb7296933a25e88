"""``curkv-train``: LightningCLI for fit/validate, plus recipes / export / eval / plan commands."""

from __future__ import annotations

import sys

from lightning.pytorch.cli import LightningCLI

from curkv_train.errors import CurKVError
from curkv_train.recipes import expand_recipe_flag, list_recipes, recipe_path


class CurKVCLI(LightningCLI):
    """LightningCLI with the data module's tokenizer and protected spans linked to the model's."""

    def add_arguments_to_parser(self, parser) -> None:
        parser.link_arguments("model.base_model", "data.tokenizer")
        parser.link_arguments("model.base_fallback", "data.tokenizer_fallback")
        parser.link_arguments("model.n_sink", "data.n_sink")
        parser.link_arguments("model.window", "data.window")

    def before_fit(self) -> None:
        """Check the output folders before Lightning creates any (a one-line error, not a traceback)."""
        from curkv_train.callbacks.guards import check_before_fit

        check_before_fit(self.trainer)


LIGHTNING_SUBCOMMANDS = ("fit", "validate", "test", "predict")


def build_cli(args: list[str], run: bool = True) -> CurKVCLI:
    """The Lightning CLI over ``args`` (``--recipe`` already expandable).

    ``run=False`` parses and instantiates (model, data, trainer) without running; a leading
    subcommand (``["fit", "--recipe", NAME]``) is accepted and dropped then.
    """
    from curkv_train.data.datamodule import CurKVDataModule
    from curkv_train.system import CurKVModule

    args = expand_recipe_flag(args)
    if not run and args and args[0] in LIGHTNING_SUBCOMMANDS:
        args = args[1:]
    return CurKVCLI(CurKVModule, CurKVDataModule, args=args, run=run, save_config_kwargs={"overwrite": True})


def recipes_command(args: list[str]) -> int:
    """Print every recipe with the file it comes from."""
    for name in list_recipes():
        print(f"{name:16s} {recipe_path(name)}")
    return 0


def extra_commands() -> dict:
    """Subcommands that are not Lightning's own, by name."""
    commands = {"recipes": recipes_command}
    for name, module in (("export", "curkv_train.export"), ("eval", "curkv_train.eval.cli"),
                         ("plan", "curkv_train.plan")):
        commands[name] = _lazy(module)
    return commands


def _lazy(module: str):
    def run(args: list[str]) -> int:
        import importlib

        return importlib.import_module(module).main(args)

    return run


def main(argv: list[str] | None = None) -> int:
    """Entry point; user errors print one line and exit with status 2."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        commands = extra_commands()
        if args and args[0] in commands:
            return commands[args[0]](args[1:])
        build_cli(args)
    except CurKVError as error:
        print(f"curkv-train: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
