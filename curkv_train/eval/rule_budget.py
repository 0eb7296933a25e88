"""A training-free rule's own layer budget, calibrated as the scorer's is: ``curkv-train calibrate --method RULE``.

The comparison "the rule at an allocation calibrated for that rule itself" needs the rule's own split. It is
measured the way :mod:`curkv_train.eval.calibrate` measures the scorer's, on the same training blocks. There is one
difference: the rule runs as the evaluation runs it, a kvpress press compressing a prefill once. For each decoder
layer, that layer alone keeps ``probe_keep`` under the rule, and the continuation's perplexity increase is its
sensitivity. Each candidate (exponent, floor) then splits ``keep_ratio`` across layers, and the best split is written
as a JSON file. ``curkv-train eval --rule_budgets RULE=FILE`` runs the row ``RULE@own`` at it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from transformers import DynamicCache, PreTrainedModel

from curkv_train.core.atomic import write_atomic
from curkv_train.core.errors import CurKVError
from curkv_train.eval import kvpress_bridge
from curkv_train.eval.compressed import continuation_logits
from curkv_train.eval.metrics import token_nll
from curkv_train.runtime.allocation import LayerBudget, ProbeBudget
from curkv_train.runtime.attention import install_runtime_attention

OWN = "@own"


class PrefillCalibration:
    """Prefills each block's first ``context`` tokens under a press and measures the rest's mean NLL."""

    def __init__(self, model: PreTrainedModel, documents: list[torch.Tensor], context: int, *, n_sink: int,
                 window: int) -> None:
        self.model, self.documents, self.context, self.n_sink, self.window = model, documents, context, n_sink, window
        self.full_nll = self._nll(None)

    def _nll(self, method: kvpress_bridge.PressMethod | None, keep: float = 1.0) -> float:
        nll, tokens = 0.0, 0
        for ids in self.documents:
            context, continuation = ids[:, :self.context], ids[:, self.context:]
            if method is None:
                cache = DynamicCache(config=self.model.config)
                with torch.no_grad():
                    self.model.get_decoder()(input_ids=context, past_key_values=cache, use_cache=True)
            else:
                press = method.press(self.context, 1.0 - keep, 0, n_sink=self.n_sink, window=self.window)
                cache = kvpress_bridge.press_cache(self.model, method.spec, press, context, seed=0)[0]
            logits = continuation_logits(self.model, cache, continuation, self.context)
            values = token_nll(logits[:, :-1], continuation[:, 1:])
            nll, tokens = nll + float(values.sum()), tokens + values.numel()
        return nll / tokens

    def increase(self, rule: str, keep: float, budget: LayerBudget) -> float:
        """Perplexity increase (%) of ``rule`` at mean keep ``keep`` split by ``budget``, over the full cache."""
        method = kvpress_bridge.baseline_method(rule, n_sink=self.n_sink, window=self.window, layer_budget=budget)
        return 100.0 * (math.exp(self._nll(method, keep) - self.full_nll) - 1.0)


def calibrate_rule(model: PreTrainedModel, rule: str, documents: list[torch.Tensor], out: Path, *, context: int,
                   keep_ratio: float, probe_keep: float, exponents: list[float], floors: list[float], n_sink: int,
                   window: int, say) -> LayerBudget:
    """Measure ``rule``'s per-layer sensitivity on ``documents`` (1, tokens) and write its best budget to ``out``."""
    if rule not in kvpress_bridge.BASELINE_PRESSES:
        raise CurKVError(f"unknown rule {rule!r}; expected one of {', '.join(kvpress_bridge.BASELINE_PRESSES)}")
    layers = model.config.num_hidden_layers
    with install_runtime_attention(model, factored=False, per_layer=True):  # the layers hold different counts
        calibration = PrefillCalibration(model, documents, context, n_sink=n_sink, window=window)
        sensitivity = tuple(calibration.increase(rule, probe_keep, ProbeBudget((1.0,) * layers, layer=layer,
                                                                               keep=probe_keep))
                            for layer in range(layers))
        say(f"{rule} sensitivity (% perplexity, one layer at keep {probe_keep}): "
            f"{', '.join(f'{value:.3f}' for value in sensitivity)}")
        tried = {}
        for exponent, floor in [(0.0, 1.0)] + [(e, f) for e in exponents if e != 0 for f in floors]:
            tried[exponent, floor] = calibration.increase(rule, keep_ratio, LayerBudget(sensitivity, exponent, floor))
            say(f"{rule} exponent {exponent:g}, floor {floor:g}: +{tried[exponent, floor]:.3f} % at keep {keep_ratio}")
    budget = LayerBudget(sensitivity, *min(tried, key=tried.get))
    record = {**budget.record(), "method": rule, "calibration": {
        "keep_ratio": keep_ratio, "probe_keep": probe_keep, "context": context, "documents": len(documents),
        "regime": "one prefill through the rule's press",
        "ppl_increase_pct_by_exponent_floor": {f"{e:g},{f:g}": value for (e, f), value in tried.items()}}}
    write_atomic(out, json.dumps(record, indent=2, sort_keys=True) + "\n")
    return budget


def load_rule_budgets(spec: str | None) -> dict[str, LayerBudget]:
    """``RULE=FILE,...`` (``--rule_budgets``) as rule -> its calibrated budget; a one-line CurKVError for a bad entry."""
    budgets = {}
    for entry in filter(None, (spec or "").split(",")):
        rule, _, path = entry.partition("=")
        if not path or rule not in kvpress_bridge.BASELINE_PRESSES:
            raise CurKVError(f"--rule_budgets takes RULE=FILE entries with RULE one of "
                             f"{', '.join(kvpress_bridge.BASELINE_PRESSES)}; got {entry!r}")
        try:
            record = json.loads(Path(path).read_text())
        except (OSError, ValueError) as error:
            raise CurKVError(f"cannot read the layer budget {path}: {error}") from None
        if record.get("method") != rule:
            raise CurKVError(f"{path} holds the budget of {record.get('method')!r}, not {rule!r}")
        budgets[rule] = LayerBudget.from_record(record)
    return budgets
