"""Record what every shipped SmolLM2 scorer keeps on one held-out prefill: the golden file the selection test reads.

Run from a checkout whose selections are the reference (``python tests/golden/record_selections.py``);
``tests/integration/test_selection_golden.py`` replays the same prefill and compares. The file holds the
token ids, so the test does not depend on how documents are found.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import torch

GOLDEN = Path(__file__).with_name("selections.json")
BASE = "embedded:smollm2-135m-instruct"
BASE_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the hub id a SmolLM2 scorer records
KEEP_RATIO = 0.5
TOKENS = 512


def digest(tensor: torch.Tensor) -> str:
    """sha256 of a tensor's values (contiguous, on CPU)."""
    return hashlib.sha256(tensor.detach().cpu().contiguous().numpy().tobytes()).hexdigest()[:16]


def heldout_ids(tokenizer) -> list[int]:
    """The first ``TOKENS`` tokens of the first held-out Python-docs document that has that many."""
    try:
        from curkv_train.training.data import corpora
    except ImportError:  # a checkout from before the training package
        from curkv_train.data import corpora

    for document in corpora.documents("pydoc"):
        if corpora.split_of(document["id"], 0.1) == "val":
            ids = tokenizer(document["text"]).input_ids
            if len(ids) >= TOKENS:
                return ids[:TOKENS]
    raise SystemExit("no held-out document long enough")


def main() -> None:
    from curkv_train.models.base import load_base_model, load_tokenizer

    tokenizer = load_tokenizer(BASE)
    ids = heldout_ids(tokenizer)
    record = {"base": BASE, "keep_ratio": KEEP_RATIO, "ids": ids, "scorers": {}}
    model = load_base_model(BASE, attn_implementation="sdpa")
    from replay import selections

    checkpoints = Path(__file__).resolve().parents[2] / "checkpoints"
    for folder in sorted(p for p in checkpoints.iterdir() if (p / "scorer.json").is_file()):
        if json.loads((folder / "scorer.json").read_text())["base_model"]["id"] != BASE_ID:
            continue  # another base's scorer (Gemma 3): this prefill is SmolLM2's
        record["scorers"][folder.name] = selections(model, folder, torch.tensor([ids]), KEEP_RATIO)
        print(folder.name, file=sys.stderr)
    GOLDEN.write_text(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
