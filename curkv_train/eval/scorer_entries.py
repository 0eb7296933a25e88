"""Several trained scorers in one evaluation: ``--scorer main=PATH,other=PATH,fresh=init:query_aware``.

Each entry is ``label=SOURCE`` (rows ``curkv:LABEL``) or a bare ``SOURCE`` (rows ``curkv``); a source is an
exported scorer folder, a shipped checkpoint's name or ``init:FAMILY`` (an untrained estimator, seed 0). The
first entry is the main scorer: the verdict is about it, and it sets the recipe, base model and spans.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import torch
from transformers import PreTrainedModel

from curkv_train.core.errors import CurKVError
from curkv_train.eval.methods import CURKV
from curkv_train.runtime.scorer import Scorer

INIT_PREFIX = "init:"
NONE = "none"
_LABEL = re.compile(r"[A-Za-z0-9_.-]+")


@dataclass(frozen=True)
class ScorerEntry:
    """One ``--scorer`` entry: its ``label`` (None for a bare source) and ``source`` (a folder, a shipped name or
    ``init:FAMILY``)."""

    label: str | None
    source: str

    @property
    def method(self) -> str:
        """The method name of the entry's rows: ``curkv`` or ``curkv:LABEL``."""
        return CURKV if self.label is None else f"{CURKV}:{self.label}"

    @property
    def family(self) -> str | None:
        """The estimator family of an ``init:FAMILY`` entry, else None."""
        return self.source[len(INIT_PREFIX):] if self.source.startswith(INIT_PREFIX) else None

    def suffixed(self, name: str) -> str:
        """``name`` for this entry's rows: ``name`` for the bare entry, ``name:LABEL`` for a labelled one."""
        return name if self.label is None else f"{name}:{self.label}"


def parse_scorers(spec: str) -> list[ScorerEntry]:
    """The entries of a ``--scorer`` value (``none``: an empty list); a CurKVError for an empty entry or label, a label
    used twice, two bare entries, ``none`` among others, or ``init:`` with an unknown family."""
    from curkv_train.models.families import check_family

    items = [item.strip() for item in str(spec).split(",")]
    if [item.lower() for item in items] == [NONE]:
        return []
    entries = []
    for item in items:
        label, separator, source = item.partition("=")
        label, source = (label.strip(), source.strip()) if separator else (None, item)
        if not source or (separator and not label):
            raise CurKVError(f"--scorer entry {item!r} is empty; expected PATH, LABEL=PATH or LABEL=init:FAMILY, "
                             "comma-separated")
        if label is not None and not _LABEL.fullmatch(label):
            raise CurKVError(f"--scorer label {label!r} may hold only letters, digits, '_', '.' and '-'")
        if source.lower() == NONE:
            raise CurKVError("--scorer none means no scorer at all; it cannot be combined with other entries")
        entry = ScorerEntry(label, source)
        if entry.family is not None:
            check_family(entry.family)
        entries.append(entry)
    methods = [entry.method for entry in entries]
    repeated = sorted({method for method in methods if methods.count(method) > 1})
    if repeated:
        what = "bare paths (label all but one: LABEL=PATH)" if CURKV in repeated else f"labels {repeated}"
        raise CurKVError(f"--scorer has two entries with the same name: {what}")
    return entries


def load_trained(entries: list[ScorerEntry]) -> dict[str, Scorer]:
    """The exported scorers among ``entries`` by method name (``init:`` ones are built later, with the model); a
    CurKVError for a folder that cannot be loaded, or scorers recorded for different base models."""
    from curkv_train.runtime.serialization import load_scorer

    loaded = {entry.method: load_scorer(entry.source) for entry in entries if entry.family is None}
    bases = {method: (scorer.metadata.get("base_model") or {}) for method, scorer in loaded.items()}
    bases = {method: base.get("fingerprint") if isinstance(base, dict) else None for method, base in bases.items()}
    first = next(iter(bases), None)
    for method, fingerprint in bases.items():
        if fingerprint != bases[first]:
            raise CurKVError(f"scorers {first} and {method} were trained for different base models "
                             f"({loaded[first].base_model_id!r} vs {loaded[method].base_model_id!r}); "
                             "evaluate scorers of one base model per run")
    return loaded


def fresh_scorer(family: str, model: PreTrainedModel, base: str | None = None) -> Scorer:
    """An untrained estimator of ``family`` for ``model`` (seed 0, default options and spans), recording ``model``'s
    fingerprint so the runtime cache accepts it."""
    from curkv_train.core.shapes import kv_shape
    from curkv_train.models.families import build_estimator
    from curkv_train.runtime.serialization import model_fingerprint

    torch.manual_seed(0)
    estimator = build_estimator(family, kv_shape(model.config)).eval().requires_grad_(False)
    device = next(model.parameters()).device
    metadata = {"base_model": {"id": base, "fingerprint": model_fingerprint(model.config)},
                "name": f"{INIT_PREFIX}{family}"}
    return Scorer(estimator.to(device), metadata=metadata)


def build_scorers(entries: list[ScorerEntry], trained: dict[str, Scorer], model: PreTrainedModel,
                  base: str | None = None, spans: tuple[int, int] | None = None,
                  matmul_precision: str = "highest") -> dict[str, Scorer]:
    """Every entry's scorer by method name, in entry order (``init:`` ones built for ``model`` now), scoring with
    ``matmul_precision``; with ``spans`` (n_sink, window) each protects those spans instead of its own."""
    scorers = {entry.method: trained[entry.method] if entry.family is None else fresh_scorer(entry.family, model, base)
               for entry in entries}
    scorers = {name: replace(scorer, matmul_precision=matmul_precision) for name, scorer in scorers.items()}
    return scorers if spans is None else {name: replace(scorer, n_sink=spans[0], window=spans[1])
                                          for name, scorer in scorers.items()}
