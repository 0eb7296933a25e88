"""The data module: splits, block shapes, synthetic tasks, bad input."""

import random

import numpy as np
import pytest
import torch

from curkv_train.training.data.corpora import split_of
from curkv_train.training.data.datamodule import CurKVDataModule, DataSource
from curkv_train.training.data.synthetic import kv_lookup, passkey, repeated_span
from curkv_train.core.errors import CurKVError
from curkv_train.models.base import TINY_RANDOM, load_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(TINY_RANDOM)


def test_split_is_stable_and_roughly_sized():
    ids = [f"doc{i}" for i in range(2000)]
    first = [split_of(i, 0.2) for i in ids]
    assert first == [split_of(i, 0.2) for i in ids]
    assert 0.15 < first.count("val") / len(ids) < 0.25


def test_blocks_have_the_configured_shape_and_are_deterministic(tmp_path):
    (tmp_path / "a.txt").write_text("hello world, " * 400)
    (tmp_path / "b.md").write_text("# title\n" + "some prose. " * 400)
    data = CurKVDataModule(sources=[DataSource(kind="files", path=str(tmp_path), val_fraction=0.0)],
                           context_length=100, continuation_length=20, window=16, batch_size=3, train_size=6)
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    assert batch["input_ids"].shape == (3, 120) and batch["context_length"] == 100
    assert torch.equal(data.datasets["train"][4]["input_ids"], data.datasets["train"][4]["input_ids"])


def test_files_source_reads_jsonl(tmp_path):
    (tmp_path / "rows.jsonl").write_text("\n".join('{"body": "%s"}' % ("text " * 100) for _ in range(5)))
    data = CurKVDataModule(sources=[DataSource(kind="files", path=str(tmp_path), text_field="body",
                                               val_fraction=0.0)],
                           context_length=100, continuation_length=20, window=16, train_size=2)
    data.setup("fit")
    assert data.datasets["train"][0]["input_ids"].shape == (120,)


def test_too_little_text_is_a_clear_error(tmp_path):
    (tmp_path / "tiny.txt").write_text("short")
    data = CurKVDataModule(sources=[DataSource(kind="files", path=str(tmp_path), val_fraction=0.0)],
                           context_length=100, continuation_length=20, window=16)
    with pytest.raises(CurKVError, match="fewer than one block"):
        data.setup("fit")


def test_unknown_source_kind():
    with pytest.raises(CurKVError, match="unknown data source kind"):
        CurKVDataModule(sources=[DataSource(kind="wikipedia")])


@pytest.mark.parametrize("builder", [passkey, kv_lookup, repeated_span])
def test_synthetic_examples_have_exact_length_and_answer_in_range(builder, tokenizer):
    filler = tokenizer("The quick brown fox jumps over the lazy dog. " * 60)["input_ids"]
    example = builder(tokenizer, filler, 300, 64, random.Random(0), protected=(4, 32))
    assert example.input_ids.shape == (364,) and example.context_length == 300
    assert 0 <= example.answer_start < example.answer_end <= 64


def test_passkey_answer_is_in_the_compressible_context(tokenizer):
    filler = tokenizer("Grass is green. " * 100)["input_ids"]
    example = passkey(tokenizer, filler, 300, 64, random.Random(1), depth=0.5, protected=(4, 32))
    answer = example.input_ids[300 + example.answer_start : 300 + example.answer_end].tolist()
    key = tokenizer.decode(answer).strip(" .")
    context = tokenizer.decode(example.input_ids[4:300 - 32].tolist())
    assert key.isdigit() and key in context


def test_repeated_span_copies_the_context(tokenizer):
    filler = tokenizer("alpha beta gamma delta epsilon zeta eta theta " * 40)["input_ids"]
    example = repeated_span(tokenizer, filler, 300, 40, random.Random(2), depth=0.0, protected=(4, 32))
    continuation = example.input_ids[300:340].tolist()
    assert continuation == example.input_ids[4:44].tolist()


def test_synthetic_task_that_does_not_fit_is_a_clear_error(tokenizer):
    filler = tokenizer("Grass is green. " * 100)["input_ids"]
    with pytest.raises(CurKVError, match="passkey needs"):
        passkey(tokenizer, filler, 60, 64, random.Random(1), protected=(4, 32))
    with pytest.raises(CurKVError, match="passkey needs"):
        passkey(tokenizer, filler, 300, 8, random.Random(1), protected=(4, 32))


class RepeatedIds(random.Random):
    """IDs of kv_lookup records all 1111 but the sixth (5555); values and choices as random.Random draws them."""

    draws = 0

    def randrange(self, start, stop=None, step=1):
        if (start, stop) != (1000, 10000):
            return super().randrange(start, stop, step)
        self.draws += 1
        return 5555 if self.draws == 6 else 1111


@pytest.mark.parametrize("seed", range(4))
def test_kv_lookup_asks_an_id_that_has_one_value(tokenizer, seed):
    filler = tokenizer("filler text. " * 40)["input_ids"]
    example = kv_lookup(tokenizer, filler, 300, 64, RepeatedIds(seed), protected=(4, 32))
    question = tokenizer.decode(example.input_ids[300 : 300 + example.answer_start].tolist())
    answer = tokenizer.decode(example.input_ids[300 + example.answer_start : 300 + example.answer_end].tolist())
    assert question == "ID 5555:" and f"ID 5555:{answer}\n" in tokenizer.decode(example.input_ids[:300].tolist())


@pytest.mark.parametrize("builder", [passkey, kv_lookup, repeated_span])
def test_a_filler_array_gives_the_blocks_its_list_gives(builder, tokenizer):
    """The data module hands the token stream itself (an array, not copied per block) to the builders."""
    filler = tokenizer("The quick brown fox jumps over the lazy dog. " * 60)["input_ids"]
    from_list = builder(tokenizer, filler, 300, 64, random.Random(5), protected=(4, 32))
    from_array = builder(tokenizer, np.asarray(filler, dtype=np.int32), 300, 64, random.Random(5), protected=(4, 32))
    assert torch.equal(from_list.input_ids, from_array.input_ids) and from_array.input_ids.dtype == torch.long


def test_file_ids_and_so_splits_do_not_depend_on_how_the_folder_is_named(tmp_path, monkeypatch):
    from curkv_train.training.data.corpora import local_files

    (tmp_path / "corpus" / "sub").mkdir(parents=True)
    for index in range(5):
        (tmp_path / "corpus" / "sub" / f"doc{index}.txt").write_text(f"text {index}")
    monkeypatch.chdir(tmp_path)
    absolute = [document["id"] for document in local_files(str(tmp_path / "corpus"))]
    relative = [document["id"] for document in local_files("./corpus/")]
    assert absolute == relative == [f"sub/doc{index}.txt" for index in range(5)]
    assert [document["id"] for document in local_files("corpus/sub/doc3.txt")] == ["doc3.txt"]


@pytest.mark.parametrize("kind", ["files", "passkey"])
def test_a_curriculum_shape_longer_than_a_stream_is_one_error(tmp_path, kind):
    (tmp_path / "a.txt").write_text("hello world, " * 50)  # 650 byte tokens
    source = DataSource(kind=kind, path=str(tmp_path), val_fraction=0.0, filler="files")
    data = CurKVDataModule(sources=[source], context_length=100, continuation_length=40, window=16, train_size=2)
    data.setup("fit")
    with pytest.raises(CurKVError, match="fewer than one block of 1040"):
        data.set_block_shape(1000, 40)
    assert data.datasets["train"].context_length == 100  # unchanged


def test_check_shape_finds_a_synthetic_task_without_room_and_changes_nothing(tmp_path):
    """A later curriculum stage's continuation too short for the passkey's question is found when training starts
    (the curriculum calls check_shape for every stage), not when the stage draws its first block."""
    (tmp_path / "a.txt").write_text("hello world, " * 200)
    source = DataSource(kind="passkey", path=str(tmp_path), val_fraction=0.0, filler="files")
    data = CurKVDataModule(sources=[source], context_length=300, continuation_length=64, window=16, train_size=2)
    data.setup("fit")
    assert data.check_shape(400) == (400, 64)
    with pytest.raises(CurKVError, match="passkey needs"):
        data.check_shape(None, 2)
    assert (data.datasets["train"].context_length, data.datasets["train"].continuation_length) == (300, 64)


@pytest.mark.parametrize("weights", [[0.0], [1.0, -1.0], []])
def test_a_mix_without_positive_weight_is_one_error(weights):
    with pytest.raises(CurKVError, match="weights >= 0 summing to more than 0"):
        CurKVDataModule(sources=[DataSource(kind="stdlib", weight=weight) for weight in weights])
