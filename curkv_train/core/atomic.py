"""Writes a reader never sees half done: a temporary sibling renamed into place."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def write_atomic(path: Path, data: bytes | str) -> None:
    """Write ``data`` to ``path`` through a temporary file in the same folder, renamed over it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(handle, "wb") as file:
            file.write(data.encode() if isinstance(data, str) else data)
        _make_readable(Path(temporary), 0o666)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


@contextmanager
def atomic_folder(target: Path) -> Iterator[Path]:
    """Yield an empty staging folder beside ``target``; on success it replaces ``target`` whole.

    An existing ``target`` is moved aside first and removed once the new one is in place (put
    back if the rename fails). On an error inside the block nothing changes and the staging
    folder is removed.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        yield staging
        _make_readable(staging, 0o777)
        for path in staging.rglob("*"):
            _make_readable(path, 0o777 if path.is_dir() else 0o666)
        _replace_folder(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _make_readable(path: Path, mode: int) -> None:
    """Give a temporary file or folder (created 0600 / 0700) the mode a plain open / mkdir would have."""
    umask = os.umask(0)
    os.umask(umask)
    path.chmod(mode & ~umask)


def _replace_folder(source: Path, target: Path) -> None:
    """Rename ``source`` onto ``target``; an existing ``target`` is moved aside first and then removed."""
    if not target.exists():
        os.replace(source, target)
        return
    trash = Path(tempfile.mkdtemp(prefix=f".{target.name}.old.", dir=target.parent))
    os.replace(target, trash / target.name)
    try:
        os.replace(source, target)
    except OSError:
        os.replace(trash / target.name, target)
        raise
    finally:
        shutil.rmtree(trash, ignore_errors=True)
