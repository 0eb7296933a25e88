"""Every ```python block of README.md runs as written, each in a fresh namespace, in order: the README cannot rot."""

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"
PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)


def python_blocks(text: str) -> list[str]:
    """The source of every fenced ```python block of ``text``, in order."""
    return PYTHON_BLOCK.findall(text)


def test_finds_every_python_block():
    """The extraction sees a block's whole source and skips other languages (a negative control for the test below)."""
    text = "intro\n```python\nx = 1\ny = 2\n```\n```bash\nmake test\n```\n```python\nprint(x)\n```\n"
    assert python_blocks(text) == ["x = 1\ny = 2\n", "print(x)\n"]


@pytest.mark.integration
@pytest.mark.parametrize("index", range(len(python_blocks(README.read_text()))))
def test_readme_block_runs(index: int, monkeypatch):
    """Block ``index`` of README.md executes without error in a namespace of its own, as a user's CPU runs it:
    without the suite's TRITON_INTERPRET, under which ``auto`` would send the cache's CPU tensors through the
    interpreted kernels (two minutes for the generate example instead of seconds)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    source = python_blocks(README.read_text())[index]
    exec(compile(source, f"README.md python block {index + 1}", "exec"), {"__name__": f"readme_block_{index + 1}"})


def test_readme_has_the_two_usage_examples():
    """The README keeps a transformers ``generate`` example and a kvpress pipeline example, each at most 8 lines."""
    blocks = python_blocks(README.read_text())
    assert any("generate(" in block and "CurKVCache" in block for block in blocks)
    assert any("kv-press-text-generation" in block and "CurKVPress" in block for block in blocks)
    assert all(len(block.splitlines()) <= 8 for block in blocks)
