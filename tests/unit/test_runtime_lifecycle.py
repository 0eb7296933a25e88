"""The runtime leaves a user's model as it found it: CurKVCache's close / ``with`` / collection, two caches on one
model, CurKVPress inside ``with press(model):``; the small public API (TierConfig, ComputeConfig, load_base_for)."""

import copy
import dataclasses
import gc
import inspect
import json
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch

from curkv_train.core.errors import CurKVError
from curkv_train.core.observation import attention_modules
from curkv_train.models.base import TINY_RANDOM, load_base_model
from curkv_train.runtime import ComputeConfig, CurKVCache, Scorer, TierConfig, load_base_for
from runtime_helpers import TORCH, family_scorer, random_scorer

PROBE = Path(__file__).resolve().parents[1] / "untouched_model_probe.py"
COLD = TierConfig(cold=True)

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture
def model():
    """A fresh model per test: the tests watch its hooks and attention implementation."""
    return load_base_model(TINY_RANDOM, attn_implementation="sdpa")


def prompt(length: int = 100) -> torch.Tensor:
    return torch.randint(3, 512, (1, length), generator=torch.Generator().manual_seed(0))


def greedy(model, cache, new: int = 4) -> torch.Tensor:
    ids = prompt()
    return model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=new,
                          do_sample=False, pad_token_id=0)


def hooks(model) -> list[int]:
    """Forward (pre-)hooks of every module of ``model``."""
    return [len(module._forward_hooks) + len(module._forward_pre_hooks) for module in model.modules()]


def test_a_fresh_process_finds_its_model_as_it_was():
    """Caches dropped or closed, presses left (also by an exception, or with a layer budget once the cache it
    compressed is dropped): implementation, config, every module's hooks and attributes, and a plain forward's
    logits as before; while in use they did change; no training code was ever imported."""
    run = subprocess.run([sys.executable, str(PROBE)], capture_output=True, text=True, cwd=PROBE.parent, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["steps"] and all(all(step.values()) for step in result["steps"].values()), result["steps"]
    assert all(changed and implementation == "curkv_factored_sdpa"
               for changed, implementation in result["during"].values())  # the probe can see a change
    assert result["training_modules"] == []


def test_close_removes_the_hooks_and_restores_the_implementation(model):
    before = hooks(model)
    cache = CurKVCache(random_scorer(), model, keep_ratio=0.5, tiers=COLD, compute=TORCH)
    greedy(model, cache)
    assert model.config._attn_implementation == "curkv_factored_sdpa" and hooks(model) != before
    cache.close()
    cache.close()  # idempotent
    assert model.config._attn_implementation == "sdpa" and hooks(model) == before
    assert cache.closed and cache.layers[0].held_tokens > 0  # what it held stays readable


def test_the_with_block_closes_the_cache_and_a_closed_cache_refuses_use(model):
    before = hooks(model)
    with CurKVCache(random_scorer(), model, keep_ratio=0.5, compute=TORCH) as cache:
        greedy(model, cache)
        assert hooks(model) != before
    assert hooks(model) == before
    for use in (lambda: greedy(model, cache), lambda: cache.update(torch.zeros(1, 2, 1, 16), torch.zeros(1, 2, 1, 16), 0),
                lambda: copy.deepcopy(cache)):
        with pytest.raises(CurKVError, match="closed") as refused:
            use()
        assert "\n" not in str(refused.value)


def test_a_collected_cache_releases_the_model(model):
    """The finalizer holds the installation, not the cache: dropping the cache is enough."""
    before = hooks(model)
    cache = CurKVCache(random_scorer(), model, keep_ratio=0.5, tiers=COLD, compute=TORCH)
    greedy(model, cache)
    reference = weakref.ref(cache)
    del cache
    gc.collect()
    assert reference() is None
    assert model.config._attn_implementation == "sdpa" and hooks(model) == before


def test_closing_one_of_two_caches_leaves_the_other_served(model):
    """A query-aware scorer reads the queries the hooks record: the open cache still generates as a cache alone
    does, and the factored wrapper stays while a cache that asked for it is open."""
    scorer, tiers = family_scorer("query_aware"), TierConfig(cold=True, warm_windows=1, cold_block=8)
    alone = CurKVCache(scorer, model, keep_ratio=0.5, tiers=tiers, compute=TORCH)
    expected = greedy(model, alone, new=40)
    alone.close()
    first = CurKVCache(scorer, model, keep_ratio=0.5, tiers=tiers, compute=TORCH)
    second = CurKVCache(scorer, model, keep_ratio=0.5, tiers=tiers, compute=TORCH)
    greedy(model, first)
    first.close()
    assert model.config._attn_implementation == "curkv_factored_sdpa"
    assert torch.equal(greedy(model, second, new=40), expected)
    assert second.layers[0].cold  # the factored path ran
    second.close()
    assert model.config._attn_implementation == "sdpa" and sum(hooks(model)) == 0


def test_a_copy_holds_the_model_on_its_own(model):
    cache = CurKVCache(random_scorer(), model, keep_ratio=0.5, compute=TORCH)
    with torch.no_grad():
        model(prompt(), past_key_values=cache)
    twin = copy.deepcopy(cache)
    cache.close()
    assert not twin.closed and any(module._forward_pre_hooks for module in attention_modules(model))
    with torch.no_grad():
        model(prompt(5), past_key_values=twin)
    assert twin.get_seq_length() == 105
    twin.close()
    assert sum(hooks(model)) == 0


def test_the_press_touches_the_model_only_inside_its_block(model):
    pytest.importorskip("kvpress")
    from curkv_train.runtime import CurKVPress, LayerBudget

    budgeted = dataclasses.replace(random_scorer(window=16), layer_budget=LayerBudget((0.1, 4.0)))
    before = [hooks(model), [module._modules.get("rotary_emb") for module in attention_modules(model)]]
    press = CurKVPress(scorer=budgeted, compression_ratio=0.5)
    with pytest.raises(RuntimeError, match="inside"):
        with press(model):
            assert model.config._attn_implementation == "curkv_factored_sdpa"
            raise RuntimeError("inside the press")
    assert model.config._attn_implementation == "sdpa"
    assert [hooks(model), [module._modules.get("rotary_emb") for module in attention_modules(model)]] == before


def test_a_budgeted_press_keeps_the_wrapper_while_its_cache_lives(model):
    """kvpress's pipeline answers from the compressed cache after ``with press(model):``: its layers hold different
    counts, so the wrapper that fits the mask stays until the cache is dropped."""
    pytest.importorskip("kvpress")
    from transformers import DynamicCache

    from curkv_train.runtime import CurKVPress, LayerBudget

    budgeted = dataclasses.replace(random_scorer(window=16), layer_budget=LayerBudget((0.1, 4.0)))
    cache = DynamicCache()
    with torch.no_grad():
        with CurKVPress(scorer=budgeted, compression_ratio=0.5)(model):
            model(prompt(), past_key_values=cache)
        assert cache.layers[0].keys.shape[2] != cache.layers[1].keys.shape[2]
        assert model.config._attn_implementation == "curkv_factored_sdpa"
        model(prompt(3), past_key_values=cache, position_ids=torch.arange(100, 103)[None])
    del cache
    gc.collect()
    assert model.config._attn_implementation == "sdpa" and sum(hooks(model)) == 0


def test_the_configs_keep_the_earlier_defaults_and_the_cache_few_parameters():
    assert dataclasses.asdict(TierConfig()) == {
        "recent_share": 0.5, "n_sink": None, "window": None, "hot": True, "hot_windows": 2, "compress_every": 2,
        "warm": True, "warm_windows": 10, "cold": False, "cold_block": None, "cold_rows": None,
        "cold_channels": None, "cold_core": "optimal", "compensation": True, "compensation_ratio": 0.05,
        "scoring_batch_tokens": None, "allocation": None, "head_floor": None,  # None: the scorer's (its allocation's)
        "budget_prior": 0.0}
    assert dataclasses.asdict(ComputeConfig()) == {"backend": "auto", "factored_attention": True,
                                                   "compile_scorer": False, "scorer_precision": None,
                                                   "scoring_graphs": False}
    assert list(inspect.signature(CurKVCache).parameters) == [
        "scorer", "model", "keep_ratio", "max_tokens", "max_bytes", "layer_budget", "tiers", "compute"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        TierConfig().cold = True


@pytest.mark.parametrize("make, message", [
    (lambda: TierConfig(hot_windows=0), "hot_windows must be a whole number >= 1"),
    (lambda: TierConfig(window=2.5), "window must be a whole number >= 1"),
    (lambda: TierConfig(scoring_batch_tokens=-1), "scoring_batch_tokens must be a whole number >= 0"),
    (lambda: TierConfig(cold_core="svd"), "unknown cold_core 'svd'"),
    (lambda: TierConfig(compensation_ratio=1.5), "compensation_ratio must be in"),
    (lambda: ComputeConfig(backend="cuda"), "unknown backend 'cuda'"),
    (lambda: ComputeConfig(scorer_precision="bf16"), "unknown matmul precision 'bf16'"),
])
def test_bad_settings_are_one_line_errors(make, message):
    with pytest.raises(CurKVError, match=message) as refused:
        make()
    assert "\n" not in str(refused.value)


def test_settings_of_the_wrong_kind_are_refused(model):
    with pytest.raises(CurKVError, match="tiers must be a TierConfig"):
        CurKVCache(random_scorer(), model, tiers={"cold": True})
    with pytest.raises(CurKVError, match="compute must be a ComputeConfig"):
        CurKVCache(random_scorer(), model, compute=TierConfig())


def test_load_base_for_reads_the_scorers_base_and_falls_back_offline(tmp_path, model):
    from curkv_train.runtime import model_fingerprint, save_scorer

    folder = save_scorer(random_scorer(), tmp_path / "scorer", base_model=TINY_RANDOM,
                         fingerprint=model_fingerprint(model.config))
    loaded, tokenizer = load_base_for(folder)
    assert loaded.config._attn_implementation == "sdpa" and tokenizer("abc").input_ids
    offline = Scorer(random_scorer().estimator, metadata={
        "base_model": {"id": "nobody/no-such-model"}, "training": {"hyper_parameters": {"base_fallback": TINY_RANDOM}}})
    assert (offline.base_model_id, offline.base_fallback) == ("nobody/no-such-model", TINY_RANDOM)
    assert load_base_for(offline)[0].config.num_hidden_layers == 2
    with pytest.raises(CurKVError, match="records no base model"):
        load_base_for(random_scorer())


def test_a_scorer_json_without_a_family_is_refused(tmp_path):
    from curkv_train.runtime import load_scorer, save_scorer

    folder = save_scorer(random_scorer(), tmp_path / "scorer")
    record = json.loads((folder / "scorer.json").read_text())
    del record["estimator"]["family"]
    (folder / "scorer.json").write_text(json.dumps(record))
    with pytest.raises(CurKVError, match="names no family"):
        load_scorer(folder)


def test_the_package_reports_its_installed_version():
    from importlib import metadata

    import curkv_train

    assert curkv_train.__version__ == metadata.version("curkv-train")
