"""The Llama-2 recipes: parse through the real CLI, their strategies are Lightning's own with the settings
DESIGN §8 asks for, and the 70B base instantiates on the meta device with the right shapes."""

import pytest
import torch
from jsonargparse import ArgumentParser
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, SingleDeviceStrategy, Strategy
from torch.distributed.fsdp import ShardingStrategy
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from curkv_train.training.callbacks.curriculum import Curriculum
from curkv_train.training.callbacks.guards import NonFiniteLossGuard, OutputSpaceGuard
from curkv_train.cli import build_cli
from curkv_train.training.distributed import KeepDtypesFSDPPrecision, prepare_rank_zero_loading, saves_sharded_checkpoints
from curkv_train.core.errors import CurKVError
from curkv_train.models.configs import build_meta_model, kv_shape, load_model_config
from curkv_train.models.seed_estimator import ValueEstimator
from curkv_train.models.families import build_estimator
from curkv_train.cli import parse_recipe
from recipe_flags import ON_CPU



def strategy_and_plugins(recipe: str):
    """The recipe's trainer.strategy and trainer.plugins, parsed by the real CLI and built by jsonargparse."""
    trainer = parse_recipe(recipe).trainer
    parser = ArgumentParser()
    parser.add_argument("--strategy", type=Strategy)
    parser.add_argument("--plugins", type=list[Precision] | None, default=None)
    config = parser.parse_object({"strategy": trainer.strategy.as_dict(),
                                  "plugins": [plugin.as_dict() for plugin in trainer.plugins or []]})
    built = parser.instantiate(config)
    return built.strategy, built.plugins or []


@pytest.mark.parametrize("recipe", ["llama2-7b", "llama2-70b"])
def test_recipe_builds_through_the_cli(recipe, tmp_path):
    cli = build_cli(["fit", "--recipe", recipe, f"--trainer.default_root_dir={tmp_path}", *ON_CPU], run=False)
    assert cli.model.hparams.base_dtype == "bfloat16" and cli.model.hparams.budget_weight > 0
    assert cli.datamodule.max_positions == 4096
    kinds = {source.kind for source in cli.datamodule.sources}
    assert {"hub", "passkey", "kv_lookup", "repeated_span"} <= kinds
    assert all(source.name == "emozilla/pg19" for source in cli.datamodule.sources)
    callbacks = {type(callback) for callback in cli.trainer.callbacks}
    assert {Curriculum, NonFiniteLossGuard, OutputSpaceGuard} <= callbacks
    curriculum = next(c for c in cli.trainer.callbacks if isinstance(c, Curriculum))
    final = curriculum.settings_at(10**6)
    assert final["context_length"] + final["continuation_length"] == 4096 and final["hard_topk"]
    assert curriculum.settings_at(0)["context_length"] < final["context_length"]  # contexts ramp up


def test_llama2_70b_uses_lightning_fsdp_as_designed():
    strategy, plugins = strategy_and_plugins("llama2-70b")
    assert type(strategy) is FSDPStrategy
    assert strategy.sharding_strategy == ShardingStrategy.FULL_SHARD
    assert saves_sharded_checkpoints(strategy)
    assert strategy.kwargs["use_orig_params"] is True  # frozen base and trainable estimator side by side
    assert strategy.kwargs["limit_all_gathers"] is True
    wrap = strategy.kwargs["auto_wrap_policy"]
    assert isinstance(wrap, ModuleWrapPolicy)
    assert set(wrap._module_classes) == {LlamaDecoderLayer, ValueEstimator}
    assert set(strategy._activation_checkpointing_kwargs["auto_wrap_policy"]._module_classes) == {LlamaDecoderLayer}
    assert [type(plugin) for plugin in plugins] == [KeepDtypesFSDPPrecision]


def test_llama2_7b_uses_lightning_ddp_without_unused_parameter_search():
    strategy, plugins = strategy_and_plugins("llama2-7b")
    assert type(strategy) is DDPStrategy and plugins == []
    assert strategy._ddp_kwargs["find_unused_parameters"] is False


def test_llama2_70b_base_on_meta_and_its_estimator(tmp_path):
    cli = build_cli(["fit", "--recipe", "llama2-70b", f"--trainer.default_root_dir={tmp_path}", *ON_CPU], run=False)
    config = load_model_config(cli.model.hparams.base_model)
    shape = kv_shape(config)
    assert (shape.num_layers, shape.num_kv_heads, shape.head_dim) == (80, 8, 128)
    base = build_meta_model(config)
    assert len(base.model.layers) == 80 and base.model.layers[79].self_attn.v_proj.weight.shape == (1024, 8192)
    estimator = build_estimator(cli.model.hparams.estimator, shape, **(cli.model.hparams.estimator_options or {}))
    assert abs(sum(p.numel() for p in estimator.parameters()) - 2.75e6) < 0.01e6


def test_keep_dtypes_precision_casts_nothing():
    module = torch.nn.ModuleDict({"base": torch.nn.Linear(4, 4).to(torch.bfloat16), "estimator": torch.nn.Linear(4, 1)})
    precision = KeepDtypesFSDPPrecision()
    assert precision.convert_module(module) is module
    assert (module.base.weight.dtype, module.estimator.weight.dtype) == (torch.bfloat16, torch.float32)
    mixed = precision.mixed_precision_config
    assert (mixed.param_dtype, mixed.reduce_dtype, mixed.buffer_dtype) == (None, None, None)


def test_rank_zero_loading_needs_fsdp():
    strategy = FSDPStrategy()
    prepare_rank_zero_loading(strategy)
    assert strategy.kwargs["sync_module_states"] is True and callable(strategy.kwargs["param_init_fn"])
    with pytest.raises(CurKVError, match="base_init=rank_zero needs trainer.strategy FSDPStrategy"):
        prepare_rank_zero_loading(SingleDeviceStrategy(torch.device("cpu")))
