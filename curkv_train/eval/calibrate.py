"""``curkv-train calibrate``: measure how much each layer's compression costs, and record the layer budget.

Blocks of the scorer's own training split are streamed through the runtime cache as the streaming task
does. Per decoder layer, the cache compresses that layer alone to ``probe_keep``: the perplexity increase
is the layer's sensitivity. Each candidate (exponent, floor) of :class:`~curkv_train.runtime.allocation.LayerBudget`
(exponent 0, one ratio for every layer, among them) then splits ``keep_ratio`` across layers on the same documents;
the best is written into the scorer's ``scorer.json`` (atomically), where CurKVCache reads it by default. Both the
exponent and the floor are chosen here, on training blocks: no evaluation document takes part.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import torch
from transformers import PreTrainedModel

from curkv_train.core.atomic import write_atomic
from curkv_train.core.errors import CurKVError
from curkv_train.eval.runtime_caches import plain_cache
from curkv_train.eval.lists import FloatList
from curkv_train.eval.streaming import stream_document
from curkv_train.eval.tasks import DataRecipe
from curkv_train.models.base import load_base_model, load_tokenizer
from curkv_train.runtime.allocation import LayerBudget, ProbeBudget
from curkv_train.runtime.cache import CurKVCache
from curkv_train.runtime.cache_config import TierConfig
from curkv_train.runtime.hybrid import sliding_layers
from curkv_train.runtime.scorer import Scorer
from curkv_train.runtime.serialization import CONFIG_FILE, load_base_for, load_scorer, resolve_scorer_dir


def calibration_documents(tokenizer, recipe: DataRecipe, *, length: int, per_source: int) -> list[torch.Tensor]:
    """(1, length) token blocks of the training split of every document source of ``recipe`` (a synthetic
    task counts as its filler, :class:`~curkv_train.eval.tasks.DataRecipe`), ``per_source`` of each, spread
    evenly over its stream."""
    from curkv_train.training.data.tokenized import token_stream

    blocks = []
    for source in recipe.sources:
        stream = token_stream(tokenizer, source.kind, "train", **source.arguments())
        if len(stream) < length:
            continue
        step = (len(stream) - length) // per_source
        blocks += [torch.from_numpy(stream[index * step : index * step + length].copy())[None]
                   for index in range(per_source)]
    if not blocks:
        raise CurKVError(f"the scorer's recipe has no text or code source with {length} training tokens to "
                         "calibrate on; lower --length")
    return blocks


class Calibration:
    """Streams the calibration documents through caches and measures the perplexity increase (%)."""

    def __init__(self, model: PreTrainedModel, scorer: Scorer, documents: list[torch.Tensor], *, prefix: int,
                 chunk: int) -> None:
        self.model, self.scorer, self.documents, self.prefix, self.chunk = model, scorer, documents, prefix, chunk
        self.full_nll = self._nll(lambda: plain_cache(model))

    def _nll(self, cache) -> float:
        """Mean NLL over every scored token of every document, each streamed through a fresh ``cache()``."""
        traces = [stream_document(self.model, cache(), ids, self.prefix, self.chunk)
                  for ids in self.documents]
        return float(np.concatenate([trace.nll for trace in traces]).mean())

    def increase(self, keep_ratio: float, budget: LayerBudget | str) -> float:
        """Perplexity increase (%) of the runtime cache at ``keep_ratio`` with ``budget`` over the full cache (a layer
        budget splits per head, whatever allocation the scorer was trained under)."""
        nll = self._nll(lambda: CurKVCache(self.scorer, model=self.model, keep_ratio=keep_ratio, layer_budget=budget,
                                           tiers=TierConfig(allocation="per_head")))
        return 100.0 * (math.exp(nll - self.full_nll) - 1.0)


def calibrate(scorer: str, keep_ratio: float = 0.5, probe_keep: float = 0.3, exponents: FloatList = FloatList([0.5, 1.0, 2.0]),
              floors: FloatList = FloatList([0.2, 0.4, 0.6]), length: int = 2048, prefix: int = 512, chunk: int = 64,
              per_source: int = 1, base: str | None = None, method: str = "curkv", out: str | None = None,
              context: int = 1024, continuation: int = 128) -> LayerBudget:
    """Measure every layer's sensitivity and write the scorer's layer budget into its scorer.json.

    Args:
        scorer: the scorer folder (``checkpoints/NAME``); its scorer.json is rewritten in place.
        keep_ratio: the mean keep ratio the exponents are compared at.
        probe_keep: the keep ratio of the one layer compressed when measuring its sensitivity.
        exponents: candidate exponents (0, one ratio for every layer, is always tried).
        floors: candidate floors, each layer's least keep ratio as a share of the mean, in (0, 1]; every
            exponent is tried with every floor.
        length: tokens per calibration document.
        prefix: tokens of it prefilled at once (the perplexity is over the rest).
        chunk: tokens fed per step after the prefix.
        per_source: documents per text or code source of the scorer's recipe.
        base: the base model (default: the one the scorer records).
        method: ``curkv`` (the scorer, written into its scorer.json) or a training-free rule (snapkv,
            expected_attention, ... : :mod:`curkv_train.eval.rule_budget`), calibrated on the scorer's base and
            training blocks as the evaluation runs it (one prefill of ``context`` tokens, ``continuation`` scored),
            written to ``out``.
        out: the JSON file a rule's budget is written to (``--rule_budgets RULE=FILE`` in ``curkv-train eval``).

    Returns:
        The budget written.
    """
    if not floors or any(not 0.0 < floor <= 1.0 for floor in floors):
        raise CurKVError(f"calibrate needs floors in (0, 1], got {list(floors)}")
    if not (0.0 < probe_keep < 1.0 and 0.0 < keep_ratio < 1.0) or length <= prefix or min(prefix, chunk, per_source) < 1:
        raise CurKVError(f"calibrate needs 0 < probe_keep, keep_ratio < 1, length > prefix >= 1, chunk >= 1 and "
                         f"per_source >= 1; got {probe_keep}, {keep_ratio}, {length}, {prefix}, {chunk}, {per_source}")
    folder = resolve_scorer_dir(scorer)
    loaded = load_scorer(folder)
    if base is None:
        model, tokenizer = load_base_for(loaded)  # checked against the scorer's fingerprint
    else:
        model, tokenizer = load_base_model(base), load_tokenizer(base)
        loaded = load_scorer(folder, model=model)
    if sliding_layers(model):
        raise CurKVError("calibrate measures a per-layer budget, which a hybrid model (sliding-window layers) does not "
                         "take: its scorer's joint allocation shares the full-attention layers' tokens by score")
    if method != "curkv":
        if out is None:
            raise CurKVError(f"calibrating {method!r} writes its budget to a file: pass --out FILE")
        from curkv_train.eval.rule_budget import calibrate_rule

        documents = calibration_documents(tokenizer, DataRecipe.of_scorer(loaded.metadata),
                                          length=context + continuation, per_source=per_source)
        return calibrate_rule(model, method, documents, Path(out), context=context, keep_ratio=keep_ratio,
                              probe_keep=probe_keep, exponents=list(exponents), floors=list(floors),
                              n_sink=loaded.n_sink, window=loaded.window, say=_say)
    documents = calibration_documents(tokenizer, DataRecipe.of_scorer(loaded.metadata), length=length,
                                      per_source=per_source)
    calibration = Calibration(model, loaded, documents, prefix=prefix, chunk=chunk)
    layers = loaded.estimator.num_layers
    sensitivity = tuple(calibration.increase(1.0, ProbeBudget((1.0,) * layers, layer=layer, keep=probe_keep))
                        for layer in range(layers))
    _say(f"sensitivity (% perplexity, one layer at keep {probe_keep}): {', '.join(f'{s:.3f}' for s in sensitivity)}")
    tried = {}
    candidates = [(0.0, 1.0)] + [(float(exponent), float(floor)) for exponent in dict.fromkeys(exponents)
                                 if exponent != 0 for floor in dict.fromkeys(floors)]
    for exponent, floor in candidates:
        tried[exponent, floor] = calibration.increase(keep_ratio, LayerBudget(sensitivity, exponent, floor))
        _say(f"exponent {exponent:g}, floor {floor:g}: +{tried[exponent, floor]:.3f} % perplexity at keep {keep_ratio}")
    budget = LayerBudget(sensitivity, *min(tried, key=tried.get))
    record = {**budget.record(), "calibration": {
        "keep_ratio": keep_ratio, "probe_keep": probe_keep, "length": length, "prefix": prefix, "chunk": chunk,
        "documents": len(documents), "sources": [source.kind for source in DataRecipe.of_scorer(loaded.metadata).sources],
        "ppl_increase_pct_by_exponent_floor": {f"{exponent:g},{floor:g}": value
                                               for (exponent, floor), value in tried.items()}}}
    _write_budget(folder / CONFIG_FILE, record)
    return budget


def _write_budget(config_path: Path, budget: dict) -> None:
    """Put ``budget`` as scorer.json's ``layer_budget``, rewriting the file atomically."""
    record = json.loads(config_path.read_text())
    record["layer_budget"] = budget
    write_atomic(config_path, json.dumps(record, indent=2, sort_keys=True) + "\n")


def _say(line: str) -> None:
    print(f"curkv-train calibrate: {line}", file=sys.stderr, flush=True)


def main(**options) -> LayerBudget:
    """``curkv-train calibrate``: run :func:`calibrate`, print the exponent chosen."""
    budget = calibrate(**options)
    print(f"layer budget written: exponent {budget.exponent:g}, floor {budget.floor:g}")
    return budget
