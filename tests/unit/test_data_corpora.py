"""The embedded corpora keep to their own documents, and the token cache follows their content."""

from __future__ import annotations

import ast

from curkv_train.training.data.corpora import STDLIB_EXCLUDED, python_docs, stdlib_code
from curkv_train.training.data.tokenized import token_stream
from curkv_train.models.base import TINY_RANDOM, load_tokenizer

SPAN_WORDS = 30


def word_spans(text: str) -> set[int]:
    """Hashes of every run of SPAN_WORDS whitespace-separated words of ``text``."""
    words = text.split()
    return {hash(" ".join(words[start : start + SPAN_WORDS])) for start in range(len(words) - SPAN_WORDS + 1)}


def string_literals(source: str) -> str:
    """The string constants of a Python file, joined (how topics.py holds the pydoc prose)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return ""
    return "\n".join(node.value for node in ast.walk(tree)
                     if isinstance(node, ast.Constant) and isinstance(node.value, str))


def test_no_stdlib_file_carries_pydoc_topics():
    topics = set().union(*(word_spans(document["text"]) for document in python_docs()))
    carriers = [document["id"] for document in stdlib_code()
                if (word_spans(document["text"]) | word_spans(string_literals(document["text"]))) & topics]
    assert carriers == []
    ids = {document["id"] for document in stdlib_code()}
    assert not {f"stdlib/{path}" for path in STDLIB_EXCLUDED} & ids
    assert "stdlib/bdb.py" in ids and "stdlib/json/__init__.py" in ids  # nothing else went


def test_token_cache_follows_the_documents(tmp_path, monkeypatch):
    monkeypatch.setenv("CURKV_CACHE", str(tmp_path / "cache"))
    tokenizer = load_tokenizer(TINY_RANDOM)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("first version")
    before = token_stream(tokenizer, "files", "train", val_fraction=0.0, path=str(corpus))
    (corpus / "a.txt").write_text("second version, longer")
    after = token_stream(tokenizer, "files", "train", val_fraction=0.0, path=str(corpus))
    assert tokenizer.decode(before[:-1]) == "first version"
    assert tokenizer.decode(after[:-1]) == "second version, longer"
