"""Document sources: local files, hub datasets, and the embedded offline corpora.

Every source yields documents ``{"id": str, "text": str}``. Documents are assigned
to the train or validation split by a hash of their id, so the split is stable
across runs and machines and held-out documents never reach training.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from curkv_train.core.errors import CurKVError

TEXT_SUFFIXES = {".txt", ".md", ".rst", ".py"}
# Standard-library files that carry another source's documents verbatim, so they are not code and would
# leak one source's split into the other's: pydoc_data/topics.py is every ``pydoc`` topic as string
# literals (most of them pydoc training documents), and pdb.py's command docstrings are a third of the
# ``debugger`` topic word for word. (bdb.py shares one 27-word sentence with it and stays.)
STDLIB_EXCLUDED = frozenset({"pydoc_data/topics.py", "pdb.py"})
STDLIB_SKIPPED_FOLDERS = frozenset({"site-packages", "test", "tests", "idlelib"})
TABLE_SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def split_of(document_id: str, val_fraction: float) -> str:
    """``"val"`` for a stable ``val_fraction`` of document ids, else ``"train"``."""
    digest = int(hashlib.sha256(document_id.encode()).hexdigest()[:8], 16)
    return "val" if digest / 0xFFFFFFFF < val_fraction else "train"


def stdlib_code() -> Iterator[dict]:
    """The Python standard library's own ``.py`` sources (real code, present everywhere).

    Tests, IDLE, site-packages and :data:`STDLIB_EXCLUDED` (files embedding the ``pydoc`` documents)
    are left out.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(_stdlib_files(root)):
        relative = path.relative_to(root)
        if relative.as_posix() in STDLIB_EXCLUDED:
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        if text.strip():
            yield {"id": f"stdlib/{relative.as_posix()}", "text": text}


def _stdlib_files(root: Path) -> Iterator[Path]:
    """Every ``.py`` file under ``root`` outside :data:`STDLIB_SKIPPED_FOLDERS` (pruned, not walked)."""
    for folder, subfolders, files in os.walk(root):
        subfolders[:] = [name for name in subfolders if name not in STDLIB_SKIPPED_FOLDERS]
        yield from (Path(folder) / name for name in files if name.endswith(".py"))


def python_docs() -> Iterator[dict]:
    """English prose: the Python language reference topics shipped with CPython (pydoc_data)."""
    from pydoc_data.topics import topics

    for name in sorted(topics):
        yield {"id": f"pydoc/{name}", "text": topics[name]}


def local_files(path: str, text_field: str = "text") -> Iterator[dict]:
    """Documents from a file or a folder of .txt/.md/.py/.jsonl/.parquet files.

    A document's id (what its split is drawn from) is its path inside the folder (a file: its
    name), so the split does not depend on where the folder is or how ``path`` was written.
    """
    root = Path(path)
    if not root.exists():
        raise CurKVError(f"dataset path {path!r} does not exist")
    files = sorted(p for p in ([root] if root.is_file() else root.rglob("*")) if p.is_file())
    files = [p for p in files if p.suffix in TEXT_SUFFIXES or p.suffix in TABLE_SUFFIXES]
    if not files:
        raise CurKVError(f"dataset path {path!r} has no .txt/.md/.py/.jsonl/.parquet files")
    for file in files:
        name = file.name if root.is_file() else file.relative_to(root).as_posix()
        if file.suffix in TEXT_SUFFIXES:
            yield {"id": name, "text": file.read_text(encoding="utf-8", errors="replace")}
            continue
        yield from _table_rows(file, name, text_field)


def _table_rows(file: Path, name: str, text_field: str) -> Iterator[dict]:
    """Rows of a jsonl/parquet file through ``datasets``, keyed ``name#row``."""
    from datasets import load_dataset

    table = load_dataset(TABLE_SUFFIXES[file.suffix], data_files=str(file), split="train")
    if text_field not in table.column_names:
        raise CurKVError(f"{file} has no column {text_field!r}; columns: {', '.join(table.column_names)}")
    for row, text in enumerate(table[text_field]):
        yield {"id": f"{name}#{row}", "text": text}


def hub_dataset(name: str, config: str | None = None, split: str = "train", text_field: str = "text",
                limit: int | None = None) -> Iterator[dict]:
    """Documents of a Hugging Face dataset (streamed); a clear error when the hub is unreachable."""
    from datasets import load_dataset

    try:
        rows = load_dataset(name, config, split=split, streaming=True)
        for index, row in enumerate(rows):
            if limit is not None and index >= limit:
                return
            yield {"id": f"{name}#{index}", "text": row[text_field]}
    except (ConnectionError, OSError, ValueError) as error:
        raise CurKVError(f"dataset {name!r} cannot be loaded here ({type(error).__name__}); "
                         "use a local path or the embedded corpora (stdlib, pydoc)") from error


def documents(kind: str, path: str | None = None, name: str | None = None, text_field: str = "text",
              limit: int | None = None) -> Iterator[dict]:
    """Documents of one source kind: ``stdlib``, ``pydoc``, ``files`` (path) or ``hub`` (name)."""
    if kind == "stdlib":
        return stdlib_code()
    if kind == "pydoc":
        return python_docs()
    if kind == "files":
        if not path:
            raise CurKVError("a 'files' data source needs a path")
        return local_files(path, text_field)
    if kind == "hub":
        if not name:
            raise CurKVError("a 'hub' data source needs a dataset name")
        return hub_dataset(name, text_field=text_field, limit=limit)
    raise CurKVError(f"unknown document source {kind!r}; expected stdlib, pydoc, files or hub")
