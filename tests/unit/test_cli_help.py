"""One root parser: `curkv-train --help` and every subcommand's page list their options, and print no warning."""

import dataclasses
import json
import subprocess
import sys

import pytest

from curkv_train.cli import main
from curkv_train.eval.cli import EvalConfig
from curkv_train.training.recipes import list_recipes

# Subcommand -> options its --help must list (all generated from signatures and docstrings).
HELP_PAGES = {
    "": ["fit", "validate", "export", "eval", "compare", "plan", "recipes"],
    "fit": ["--recipe", "--trainer.max_steps", "--model.keep_ratio", "--data.context_length", "--ckpt_path",
            "--checkpoint.every_n_train_steps", "--throughput.window_size", "--output_guard.min_free_gb"],
    "validate": ["--recipe", "--ckpt_path", "--model.base_model", "--data.val_size"],
    "export": ["--ckpt", "--out", "--base_model", "--overwrite"],
    "eval": [f"--{field.name}" for field in dataclasses.fields(EvalConfig)],
    "compare": ["--run", "--pairs"],
    "plan": ["--recipe", "--devices", "--num_nodes", "--batch_size", "--json"],
    "recipes": ["List the recipes"],
}

# Runs every --help in one fresh process (imports once); prints the pages as JSON on stdout.
PRINT_PAGES = """
import contextlib, io, json, sys
from curkv_train.cli import main

pages = {}
for command in json.loads(sys.argv[1]):
    page = io.StringIO()
    with contextlib.redirect_stdout(page):
        try:
            main([*command.split(), "--help"])
        except SystemExit as exit:
            assert exit.code in (0, None), (command, exit.code)
    pages[command] = page.getvalue()
print(json.dumps(pages))
"""


@pytest.fixture(scope="module")
def help_run() -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", PRINT_PAGES, json.dumps(list(HELP_PAGES))], capture_output=True,
                          text=True, timeout=600)


def test_help_pages_print_no_warning(help_run):
    assert help_run.returncode == 0, help_run.stderr[-3000:]
    assert help_run.stderr == ""


@pytest.mark.parametrize("command", list(HELP_PAGES))
def test_help_page_lists_its_options(command, help_run):
    page = json.loads(help_run.stdout)[command]
    assert page.startswith(f"usage: curkv-train{' [options] ' + command if command else ''}"), page[:200]
    missing = [option for option in HELP_PAGES[command] if option not in page]
    assert not missing, page


def test_recipes_lists_every_recipe_file(capsys):
    assert main(["recipes"]) == 0
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert listed == list_recipes()
