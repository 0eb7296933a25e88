"""curkv-train: train value estimators for KV-cache compression."""

from __future__ import annotations


def __getattr__(name: str) -> str:
    """``__version__``: the installed distribution's version, read on first use (``import curkv_train`` stays cheap)."""
    if name != "__version__":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from importlib import metadata

    try:
        version = metadata.version("curkv-train")
    except metadata.PackageNotFoundError:  # a source tree that was never installed
        version = "0+unknown"
    globals()["__version__"] = version
    return version
