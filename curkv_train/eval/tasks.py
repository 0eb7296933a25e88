"""Evaluation tasks on held-out data: perplexity on text and code, passkey retrieval, repeated spans.

Documents come from the validation split of the scorer's own recipe, every span its training
split also holds cut out (:mod:`curkv_train.eval.heldout`); text perplexity also reads CPython's
prose files no training source reads. Synthetic examples come from string-seeded generators (a
stream of seeds training never uses) over the pydoc filler."""

from __future__ import annotations

import random
from dataclasses import dataclass, field, fields

import numpy as np
import torch

from curkv_train.core.errors import CurKVError
from curkv_train.eval.heldout import PYTHON_TEXT, DocumentSource, HeldOutText, held_out_text, join_texts
from curkv_train.eval.heldout import training_hashes
from curkv_train.training.data.synthetic import SYNTHETIC_TASKS, passkey, repeated_span

# task -> (metric kind for curkv_train.eval.metrics.finalize, token stream it reads)
TASKS = {
    "ppl_text": ("ppl", "text"),
    "ppl_code": ("ppl", "code"),
    "passkey": ("passkey", "filler"),
    "repeated_span": ("span", "filler"),
}
# stream -> the document source kinds it reads, joined in this order
STREAM_KINDS = {"text": ("pydoc", PYTHON_TEXT), "filler": ("pydoc",), "code": ("stdlib",)}
# The data sources assumed without a scorer recipe (those of the shipped recipes).
DEFAULT_SOURCES = (DocumentSource("stdlib", 0.1), DocumentSource("pydoc", 0.3))
# Every python_text document is held out: no training source reads them.
PYTHON_TEXT_SOURCE = DocumentSource(PYTHON_TEXT, 1.0)
NEVER_TRAINED = "never trained"
# The main metric of each task kind (plots and tables list every metric; this one leads).
MAIN_METRIC = {"ppl": "ppl_increase_pct", "passkey": "accuracy", "span": "token_accuracy"}
SPAN_CUE = 8


@dataclass
class TaskExample:
    """One held-out example of ``task``: ``input_ids`` (1, context + continuation), the compressed ``context_length``,
    the ``answer`` span [start, end) in continuation coordinates (None: all of it), breakdown ``tags``, the held-out
    ``documents`` its tokens came from and its resampling ``group`` ("" for a synthetic example: a unit of its own)."""

    task: str
    input_ids: torch.Tensor
    context_length: int
    answer: tuple[int, int] | None = None
    tags: dict[str, str] = field(default_factory=dict)
    documents: tuple[str, ...] = ()
    group: str = ""


def check_tasks(names: list[str], valid=TASKS) -> list[str]:
    """``names`` without duplicates, or a CurKVError listing the ``valid`` task names."""
    unknown = [name for name in names if name not in valid]
    if unknown:
        raise CurKVError(f"unknown task(s) {', '.join(map(repr, unknown))}; valid tasks: {', '.join(valid)}")
    if not names:
        raise CurKVError(f"no task selected; valid tasks: {', '.join(valid)}")
    return list(dict.fromkeys(names))


@dataclass(frozen=True)
class DataRecipe:
    """The document ``sources`` a scorer was trained on (a synthetic task counts as its filler), whose validation
    split the evaluation reads; ``origin``: ``scorer recipe`` (from its metadata) or ``default``."""

    sources: tuple[DocumentSource, ...]
    origin: str

    @classmethod
    def of_scorer(cls, metadata: dict | None) -> "DataRecipe":
        """The recipe in an exported scorer's metadata (``training.config.data.sources``), else the default."""
        config = ((metadata or {}).get("training") or {}).get("config") or {}
        entries = (config.get("data") or {}).get("sources")
        if not entries:
            return cls(DEFAULT_SOURCES, "default")
        return cls(tuple(dict.fromkeys(_document_source(entry) for entry in entries)), "scorer recipe")

    @classmethod
    def of_scorers(cls, metadata: list[dict]) -> "DataRecipe":
        """Every source of several scorers' recipes (each evaluation text held out from all of them; a scorer
        without a recorded recipe counts as trained on the default sources)."""
        recipes = [cls.of_scorer(entry) for entry in metadata]
        recorded = [recipe for recipe in recipes if recipe.origin != "default"]
        if not recorded:
            return cls(DEFAULT_SOURCES, "default")
        sources = tuple(dict.fromkeys(source for recipe in recipes for source in recipe.sources))
        if len(recorded) < len(recipes):
            return cls(sources, f"recipes of {len(recorded)} scorers and the default")
        return cls(sources, "scorer recipe" if len(recorded) == 1 else f"recipes of {len(recorded)} scorers")

    def source(self, kind: str) -> tuple[DocumentSource, str]:
        """The source the evaluation reads for ``kind`` and where its split came from: of several sources of one
        kind the smallest val_fraction (its validation split is held out from all); a kind the recipe never
        trained on, the default split; ``python_text`` held out whole."""
        if kind == PYTHON_TEXT:
            return PYTHON_TEXT_SOURCE, NEVER_TRAINED
        mine = [source for source in self.sources if source.kind == kind]
        if mine:
            return min(mine, key=lambda source: source.val_fraction), self.origin
        return next(source for source in DEFAULT_SOURCES if source.kind == kind), "default"

    def record(self) -> list[dict]:
        """The sources as plain dicts (results.json)."""
        return [{field.name: getattr(source, field.name) for field in fields(source)} for source in self.sources]


def _document_source(entry: dict) -> DocumentSource:
    """A recipe's ``data.sources`` entry (plain or jsonargparse ``init_args``) as the documents it reads."""
    from curkv_train.training.data.datamodule import DataSource

    arguments = entry.get("init_args", entry) if isinstance(entry, dict) else None
    try:
        source = DataSource(**arguments)
    except TypeError as error:
        raise CurKVError(f"the scorer's recipe has a data source the evaluation cannot read ({entry!r}): "
                         f"{error}") from error
    kind = source.filler if source.kind in SYNTHETIC_TASKS else source.kind
    return DocumentSource(kind, float(source.val_fraction), source.path, source.name, source.text_field,
                          source.limit)


def load_streams(tokenizer, tasks: list[str], recipe: DataRecipe | None = None,
                 training: tuple[np.ndarray, list[str]] | None = None) -> dict[str, HeldOutText]:
    """Held-out token streams the ``tasks`` read, every span of the recipe's training split cut out: ``text`` (the
    pydoc validation split, then every python_text file), ``filler`` (the pydoc split, the synthetic tasks'
    filler) and ``code`` (the stdlib validation split); ``training``: :func:`training_hashes`, if computed."""
    recipe = recipe or DataRecipe(DEFAULT_SOURCES, "default")
    needed = {TASKS[task][1] for task in tasks}
    seen, unchecked = training if training is not None else training_hashes(tokenizer, list(recipe.sources))
    by_kind: dict[str, HeldOutText] = {}
    streams = {}
    for name in sorted(needed):
        for kind in STREAM_KINDS[name]:
            if kind not in by_kind:
                source, origin = recipe.source(kind)
                by_kind[kind] = held_out_text(tokenizer, source, seen, unchecked, origin)
        streams[name] = join_texts([by_kind[kind] for kind in STREAM_KINDS[name]])
    return streams


def _rng(seed: int, task: str, index: int) -> random.Random:
    return random.Random(f"curkv-eval/{seed}/{task}/{index}")


def _block_starts(stream_length: int, length: int, examples: int, seed: int, task: str) -> list[int]:
    """Start of each example's block of ``length`` tokens: disjoint blocks while the stream holds enough, then
    random offsets (overlapping others: the bootstrap draws one document's examples together)."""
    if stream_length < length:
        raise CurKVError(f"the held-out stream has {stream_length} tokens, fewer than one example of {length}; "
                         "lower --context_length / --continuation_length")
    slots = stream_length // length
    disjoint = random.Random(f"curkv-eval/{seed}/{task}/blocks").sample(range(slots), min(examples, slots))
    extra = [_rng(seed, task, index).randrange(0, stream_length - length + 1) for index in range(slots, examples)]
    return [slot * length for slot in disjoint] + extra


def build_examples(task: str, tokenizer, streams: dict[str, HeldOutText | np.ndarray], *, context_length: int,
                   continuation_length: int, examples: int, seed: int, protected: tuple[int, int],
                   passkey_depths: list[float], passkey_lengths: list[int]) -> list[TaskExample]:
    """``examples`` examples of ``task`` from ``streams`` (:func:`load_streams`, or their tokens): perplexity examples
    blocks of the stream (:func:`_block_starts`), synthetic answers outside the ``protected`` (n_sink, window) spans,
    passkey examples cycling over the (length, depth) grid."""
    kind, stream_name = TASKS[task]
    held_out = streams[stream_name]
    text = held_out if isinstance(held_out, HeldOutText) else None  # with its documents
    stream = text.tokens if text else held_out
    filler = stream.tolist() if kind != "ppl" else None
    block = context_length + continuation_length
    starts = _block_starts(len(stream), block, examples, seed, task) if kind == "ppl" else []
    built = []
    for index in range(examples):
        rng = _rng(seed, task, index)
        if kind == "ppl":
            start, stop = starts[index], starts[index] + block
            ids = torch.from_numpy(stream[start:stop].copy())
            built.append(TaskExample(task, ids[None], context_length,
                                     documents=tuple(text.documents_between(start, stop)) if text else (),
                                     group=text.main_document(start, stop) if text else ""))
        elif kind == "passkey":
            grid = [(length, depth) for length in passkey_lengths for depth in passkey_depths]
            length, depth = grid[index % len(grid)]
            example = passkey(tokenizer, filler, length, continuation_length, rng, depth=depth, protected=protected)
            built.append(TaskExample(task, example.input_ids[None], length, (example.answer_start, example.answer_end),
                                     {"depth": f"{depth:g}", "length": str(length)}))
        else:
            example = repeated_span(tokenizer, filler, context_length, continuation_length, rng,
                                    protected=protected, cue_length=SPAN_CUE)
            built.append(TaskExample(task, example.input_ids[None], context_length,
                                     (example.answer_start, example.answer_end)))
        check_example(built[-1], continuation_length)
    return built


def check_example(example: TaskExample, continuation_length: int) -> None:
    """A CurKVError when a synthetic example did not fit its context or continuation."""
    total = example.input_ids.shape[-1]
    if total != example.context_length + continuation_length:
        raise CurKVError(f"{example.task}: a context of {example.context_length} tokens cannot hold the task's "
                         f"text after the protected sinks and window (got {total - continuation_length} "
                         "tokens); raise --context_length / --passkey_lengths")
    if example.answer is not None and not 1 <= example.answer[0] < example.answer[1] <= continuation_length:
        raise CurKVError(f"{example.task}: the question and answer need {example.answer[1]} continuation tokens, "
                         f"more than --continuation_length {continuation_length}")
