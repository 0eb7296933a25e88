"""Run in a fresh process by tests/unit/test_runtime_lifecycle.py: does the runtime leave a model as it found it?

Prints one JSON object: per step, whether the model's attention implementation, config, every module's hooks
and attributes and a plain forward's logits are what they were before any cache or press (and what changed while
one was in use, so a check that cannot fail shows), and the training modules ``sys.modules`` ever held.
"""

import gc
import json
import sys

import torch
from transformers import DynamicCache

from curkv_train.models.base import TINY_RANDOM, load_base_model
from curkv_train.runtime import CurKVCache, LayerBudget, TierConfig
from runtime_helpers import random_scorer

TRAINING = ("curkv_train.training", "lightning", "pytorch_lightning")
HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs",
              "_forward_hooks_always_called", "_backward_hooks", "_backward_pre_hooks")


def snapshot(model: torch.nn.Module) -> dict:
    """What the runtime must leave unchanged: the implementation, the config, per module its hooks and attributes."""
    modules = {name: {"hooks": [len(getattr(module, hooks)) for hooks in HOOK_DICTS], "attributes": sorted(vars(module)),
                      "children": sorted(module._modules)} for name, module in model.named_modules()}
    return {"implementation": model.config._attn_implementation,
            "config": {key: repr(value) for key, value in vars(model.config).items()}, "modules": modules}


def generate(model, ids: torch.Tensor, cache) -> None:
    """A few greedy tokens through ``cache``."""
    model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=4,
                   do_sample=False, pad_token_id=0)


@torch.no_grad()
def main() -> None:
    model = load_base_model(TINY_RANDOM, attn_implementation="sdpa")
    try:
        import kvpress  # noqa: F401  (imported first: it patches transformers' attention functions globally)
    except ImportError:
        kvpress = None
    ids = torch.randint(3, 512, (1, 100), generator=torch.Generator().manual_seed(0))
    logits = model(ids).logits  # once before the snapshot: kvpress's patch records an attribute on first use
    before = snapshot(model)
    scorer = random_scorer(window=16)
    budgeted = random_scorer(window=16)
    budgeted.layer_budget = LayerBudget((0.1, 4.0))
    result = {"steps": {}, "during": {}}

    def check(step: str) -> None:
        gc.collect()
        result["steps"][step] = {"model": snapshot(model) == before, "logits": torch.equal(model(ids).logits, logits)}

    cold = CurKVCache(scorer, model, keep_ratio=0.5, tiers=TierConfig(cold=True))
    per_layer = CurKVCache(budgeted, model, keep_ratio=0.5)
    generate(model, ids, cold)
    generate(model, ids, per_layer)
    result["during"]["caches"] = [snapshot(model) != before, model.config._attn_implementation]
    del cold, per_layer
    check("caches dropped")
    with CurKVCache(scorer, model, keep_ratio=0.5, tiers=TierConfig(cold=True)) as cache:
        generate(model, ids, cache)
    check("cache closed")
    if kvpress is not None:
        from curkv_train.runtime import CurKVPress

        with CurKVPress(scorer=scorer, compression_ratio=0.5)(model):
            model(ids)
        check("press exited")
        plain = DynamicCache()
        with CurKVPress(scorer=budgeted, compression_ratio=0.5)(model):
            model(ids, past_key_values=plain)
            result["during"]["press"] = [snapshot(model) != before, model.config._attn_implementation]
        model(ids[:, :3], past_key_values=plain, position_ids=torch.arange(100, 103)[None])  # layers differ in length
        del plain
        check("budgeted press exited, its cache dropped")
        try:
            with CurKVPress(scorer=budgeted, compression_ratio=0.5)(model):
                raise RuntimeError("inside the press")
        except RuntimeError:
            pass
        check("press left by an exception")
    result["training_modules"] = sorted(name for name in sys.modules if name.startswith(TRAINING))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
