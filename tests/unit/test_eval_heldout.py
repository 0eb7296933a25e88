"""The evaluation reads the scorer's own split and never a span its training split holds."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from numpy.lib.stride_tricks import sliding_window_view

from curkv_train.training.data.corpora import documents, split_of
from curkv_train.eval.heldout import SPAN, DocumentSource, held_out_text, span_hashes, training_hashes, unseen_pieces
from curkv_train.eval.tasks import DEFAULT_SOURCES, STREAM_KINDS, DataRecipe, load_streams
from curkv_train.models.base import TINY_RANDOM, load_tokenizer

SHIPPED_SCORER = Path(__file__).resolve().parents[2] / "checkpoints" / "smollm2-135m" / "scorer.json"


def other_hashes(ids: np.ndarray, span: int = SPAN) -> set[int]:
    """Span hashes by another function than the module's (a random linear form), for cross-checking."""
    if len(ids) < span:
        return set()
    weights = np.random.default_rng(0).integers(1, 2**62, span, dtype=np.int64).astype(np.uint64) | np.uint64(1)
    with np.errstate(over="ignore"):
        return set((sliding_window_view(np.asarray(ids).astype(np.uint64) + np.uint64(1), span) @ weights).tolist())


def test_span_hashes_see_equal_windows_only():
    rng = np.random.default_rng(1)
    shared = rng.integers(0, 500, 60)
    first = np.concatenate([rng.integers(0, 500, 30), shared])
    second = np.concatenate([shared, rng.integers(0, 500, 30)])
    assert len(span_hashes(first)) == len(first) - SPAN + 1 and len(span_hashes(first[:SPAN - 1])) == 0
    assert len(set(span_hashes(first).tolist()) & set(span_hashes(second).tolist())) == 60 - SPAN + 1
    assert span_hashes(np.zeros(SPAN, int))[0] != span_hashes(np.zeros(SPAN + 1, int)[1:] + 1)[0]


def test_pieces_skip_every_seen_span():
    rng = np.random.default_rng(2)
    quoted = rng.integers(0, 500, 80)
    document = np.concatenate([rng.integers(0, 500, 120), quoted, rng.integers(0, 500, 30), quoted[:55],
                               rng.integers(0, 500, 200)])
    seen = np.sort(span_hashes(np.concatenate([rng.integers(0, 500, 40), quoted])))
    pieces = unseen_pieces(document, seen)
    assert [len(piece) for piece in pieces] == [120, 200]  # the 30 tokens between the quotes are too short
    assert not set().union(*(set(span_hashes(piece).tolist()) for piece in pieces)) & set(seen.tolist())
    assert len(unseen_pieces(document, np.empty(0, np.uint64))) == 1


def write_split_files(folder: Path, split: str, texts: list[str], val_fraction: float) -> None:
    """Files named so that :func:`split_of` puts each of ``texts`` in ``split``."""
    folder.mkdir(exist_ok=True)
    number = 0
    for text in texts:
        while split_of(f"doc{number}.txt", val_fraction) != split:  # a file's id: its path in the folder
            number += 1
        (folder / f"doc{number}.txt").write_text(text)
        number += 1


def test_held_out_text_cuts_what_training_quoted(tmp_path, monkeypatch):
    monkeypatch.setenv("CURKV_CACHE", str(tmp_path / "cache"))
    tokenizer = load_tokenizer(TINY_RANDOM)
    quote = "a paragraph that both splits hold word for word, long enough to be noticed. " * 2
    corpus = tmp_path / "corpus"
    write_split_files(corpus, "train", ["training prose. " * 20 + quote], 0.5)
    write_split_files(corpus, "val", ["fresh validation prose, never trained on. " * 4 + quote
                                      + "and more fresh words " * 5], 0.5)
    source = DocumentSource("files", 0.5, path=str(corpus))
    seen, unchecked = training_hashes(tokenizer, [source])
    text = held_out_text(tokenizer, source, seen, unchecked, "scorer recipe")
    assert text.documents == 1 and text.pieces == 2 and unchecked == []
    assert len(quote) <= text.removed_tokens <= len(quote) + 4  # byte tokens: the quote and ". " before it
    decoded = tokenizer.decode(text.tokens)
    assert "fresh validation prose" in decoded and quote not in decoded
    assert text.record()["val_fraction"] == 0.5 and "tokens" not in text.record()


def test_the_recipe_of_the_scorer_sets_the_split():
    metadata = {"training": {"config": {"data": {"sources": [
        {"kind": "stdlib", "val_fraction": 0.2, "weight": 0.5},
        {"kind": "passkey", "filler": "pydoc", "val_fraction": 0.25},
        {"class_path": "curkv_train.training.data.datamodule.DataSource", "init_args": {"kind": "pydoc", "val_fraction": 0.4}},
    ]}}}}
    recipe = DataRecipe.of_scorer(metadata)
    assert recipe.origin == "scorer recipe"
    assert recipe.source("stdlib") == (DocumentSource("stdlib", 0.2), "scorer recipe")
    assert recipe.source("pydoc") == (DocumentSource("pydoc", 0.25), "scorer recipe")  # held out from both
    assert [source["val_fraction"] for source in recipe.record()] == [0.2, 0.25, 0.4]
    default = DataRecipe.of_scorer(None)
    assert default.origin == "default" and default.sources == DEFAULT_SOURCES
    assert DataRecipe.of_scorer({"training": {}}).sources == DEFAULT_SOURCES
    only_code = DataRecipe.of_scorer({"training": {"config": {"data": {"sources": [{"kind": "stdlib"}]}}}})
    assert only_code.source("pydoc") == (DocumentSource("pydoc", 0.3), "default")


def test_a_recipe_entry_the_eval_cannot_read_is_one_line():
    from curkv_train.core.errors import CurKVError

    with pytest.raises(CurKVError, match="data source the evaluation cannot read"):
        DataRecipe.of_scorer({"training": {"config": {"data": {"sources": [{"kind": "stdlib", "colour": "red"}]}}}})


@pytest.mark.integration
def test_no_eval_document_shares_a_span_with_the_shipped_recipes_training_split():
    """SmolLM2 tokens: every piece the evaluation reads against every training document, hashed independently."""
    tokenizer = load_tokenizer("embedded:smollm2-135m-instruct")
    recipe = DataRecipe.of_scorer(json.loads(SHIPPED_SCORER.read_text()))
    assert recipe.origin == "scorer recipe"
    training = set()
    for source in dict.fromkeys(recipe.sources):
        texts = [document["text"] for document in documents(source.kind)
                 if split_of(document["id"], source.val_fraction) == "train"]
        for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]:
            training |= other_hashes(ids)
    streams = load_streams(tokenizer, ["ppl_text", "ppl_code", "passkey"], recipe)
    for name, stream in streams.items():
        parts = stream.parts or [stream.record()]
        assert [part["kind"] for part in parts] == list(STREAM_KINDS[name])
        for part in parts:
            source, _ = recipe.source(part["kind"])
            assert (part["kind"], part["val_fraction"]) == (source.kind, source.val_fraction)
        pieces = np.split(stream.tokens, np.flatnonzero(stream.tokens == tokenizer.eos_token_id) + 1)
        assert len(stream.tokens) > 8 * (1024 + 128) // 2 and stream.pieces >= 10
        for piece in pieces:
            assert not other_hashes(piece[piece != tokenizer.eos_token_id]) & training, name
    # the shipped verdict needs >= 32 disjoint text examples of 1024 + 128 tokens
    assert len(streams["text"].tokens) >= 32 * (1024 + 128)
    # the check can fail: the validation documents themselves do quote the training split
    raw = [ids for source, _ in (recipe.source("pydoc"),)
           for ids in tokenizer([document["text"] for document in documents(source.kind)
                                 if split_of(document["id"], source.val_fraction) == "val"],
                                add_special_tokens=False)["input_ids"]]
    assert any(other_hashes(ids) & training for ids in raw)


def test_perplexity_examples_are_disjoint_blocks_while_the_stream_holds_them():
    from curkv_train.eval.tasks import build_examples

    stream = np.arange(1000)
    def starts(examples: int) -> list[int]:
        built = build_examples("ppl_code", None, {"code": stream}, context_length=80, continuation_length=20,
                               examples=examples, seed=0, protected=(4, 16), passkey_depths=[0.5],
                               passkey_lengths=[80])
        return [int(example.input_ids[0, 0]) for example in built]

    ten = starts(10)
    assert sorted(ten) == list(range(0, 1000, 100))  # all ten slots, in a seeded order
    assert starts(10) == ten
    assert len(starts(12)) == 12  # beyond the disjoint blocks: random offsets


def test_perplexity_examples_are_grouped_by_the_document_most_of_their_tokens_came_from():
    from curkv_train.eval.heldout import HeldOutText
    from curkv_train.eval.tasks import build_examples

    owners = np.repeat([0, 1, 2], [150, 600, 250])  # a: tokens 0-149, b: 150-749, c: 750-999
    stream = HeldOutText(np.arange(1000), "stdlib", 0.1, "default", 3, 3, 1000, 0, [], owners, ["a", "b", "c"])
    built = build_examples("ppl_code", None, {"code": stream}, context_length=80, continuation_length=20,
                           examples=10, seed=0, protected=(4, 16), passkey_depths=[0.5], passkey_lengths=[80])
    groups = {int(example.input_ids[0, 0]): example.group for example in built}
    # 100-199 and 700-799 hold 50 tokens of each of two documents: the first in stream order
    assert groups == {0: "a", 100: "a", 200: "b", 300: "b", 400: "b", 500: "b", 600: "b", 700: "b", 800: "c",
                      900: "c"}
    assert {int(example.input_ids[0, 0]): example.documents for example in built}[100] == ("a", "b")
    untracked = build_examples("ppl_code", None, {"code": np.arange(1000)}, context_length=80, continuation_length=20,
                               examples=2, seed=0, protected=(4, 16), passkey_depths=[0.5], passkey_lengths=[80])
    assert [example.group for example in untracked] == ["", ""]  # no documents: each example its own unit


def test_a_scorer_without_a_recipe_keeps_its_default_sources_next_to_one_with_a_recipe():
    recorded = {"training": {"config": {"data": {"sources": [{"kind": "pydoc", "val_fraction": 0.5}]}}}}
    recipe = DataRecipe.of_scorers([recorded, {}])
    assert set(DEFAULT_SOURCES) <= set(recipe.sources) and len(recipe.sources) == 3
    assert recipe.origin == "recipes of 1 scorers and the default"
    assert recipe.source("pydoc")[0].val_fraction == 0.3  # the smaller held-out share: held out from both
    assert DataRecipe.of_scorers([recorded]).origin == "scorer recipe"
