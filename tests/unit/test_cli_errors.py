"""Bad input: one clear line on stderr, exit status 2, nothing half-written."""

import subprocess
import sys

import pytest
import torch

from curkv_train.cli import main


def run_cli(*args: str, tmp_path=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "curkv_train.cli", *args], capture_output=True, text=True,
                          cwd=tmp_path, timeout=300)


def assert_one_line_error(capsys, code: int, needle: str) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err and err[-1].startswith("curkv-train: error:"), err
    assert needle in err[-1], err[-1]
    return err[-1]


def test_unknown_recipe_lists_close_matches(capsys):
    line = assert_one_line_error(capsys, main(["fit", "--recipe", "smollm2-13m"]), "unknown recipe")
    assert "smollm2-135m" in line


def test_malformed_recipe_yaml(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  keep_ratio: [0.5\n")
    assert_one_line_error(capsys, main(["fit", "--recipe", str(bad)]), "not valid YAML")


def test_missing_model_path(tmp_path, capsys):
    code = main(["fit", "--recipe", "tiny-debug", f"--model.base_model={tmp_path}/nope",
                 f"--trainer.default_root_dir={tmp_path}"])
    assert_one_line_error(capsys, code, "does not exist")


@pytest.mark.parametrize("ratio", ["0", "1.5", "-0.2"])
def test_keep_ratio_outside_unit_interval(ratio, capsys):
    assert_one_line_error(capsys, main(["fit", "--recipe", "tiny-debug", f"--model.keep_ratio={ratio}"]),
                          "keep_ratio must be in (0, 1]")


def test_unknown_query_feature(tmp_path, capsys):
    code = main(["fit", "--recipe", "tiny-debug", "--model.estimator=query_aware",
                 "--model.estimator_options={features: [window_attention, key_norm]}",
                 f"--trainer.default_root_dir={tmp_path}"])
    assert_one_line_error(capsys, code, "unknown query features ['key_norm']")


def test_context_shorter_than_sinks_and_window(capsys):
    code = main(["fit", "--recipe", "tiny-debug", "--data.context_length=20"])
    assert_one_line_error(capsys, code, "must exceed n_sink + window")


def test_sequence_longer_than_model_positions(capsys):
    code = main(["fit", "--recipe", "tiny-debug", "--data.context_length=2000", "--data.continuation_length=100"])
    assert_one_line_error(capsys, code, "exceeds the model's 2048 positions")


def test_empty_dataset_folder(tmp_path, capsys):
    (tmp_path / "data").mkdir()
    code = main(["fit", "--recipe", "tiny-debug", f"--trainer.default_root_dir={tmp_path}/run",
                 f"--data.sources=[{{kind: files, path: {tmp_path}/data}}]"])
    assert_one_line_error(capsys, code, "has no .txt/.md/.py/.jsonl/.parquet files")
    assert not (tmp_path / "run" / "lightning_logs" / "version_0" / "checkpoints").exists()


def test_dataset_without_text(tmp_path, capsys):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "blank.txt").write_text("   \n\n")
    code = main(["fit", "--recipe", "tiny-debug", f"--trainer.default_root_dir={tmp_path}/run",
                 f"--data.sources=[{{kind: files, path: {tmp_path}/data}}]"])
    assert_one_line_error(capsys, code, "has no text")


def test_console_entry_point_exit_status(tmp_path):
    result = run_cli("fit", "--recipe", "nope", tmp_path=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith("curkv-train: error: unknown recipe")


def test_exporting_a_checkpoint_folder_names_the_consolidation(tmp_path, capsys):
    sharded = tmp_path / "last.ckpt"  # FSDP writes a sharded checkpoint as a folder
    sharded.mkdir()
    line = assert_one_line_error(capsys, main(["export", "--ckpt", str(sharded), "--out", str(tmp_path / "out")]),
                                 "is a folder (an FSDP sharded checkpoint?)")
    assert "consolidate_checkpoint" in line and not (tmp_path / "out").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="asks for a GPU where there is none")
def test_a_gpu_recipe_without_a_gpu_is_one_line(tmp_path, capsys):
    code = main(["fit", "--recipe", "tiny-debug", "--trainer.accelerator", "gpu", f"--trainer.default_root_dir={tmp_path}"])
    assert_one_line_error(capsys, code, "No supported gpu backend found")
