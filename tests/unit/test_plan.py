"""``curkv-train plan``: the numbers match a hand calculation from the model config (DESIGN §8)."""

import json

import pytest

from curkv_train.cli import main, parse_recipe
from curkv_train.training.plan import compute_plan


def plan_of(recipe: str, overrides: list[str] | None = None):
    return compute_plan(recipe, parse_recipe(recipe, overrides))

LLAMA2_70B_PARAMETERS = 68_976_648_192
ESTIMATOR_70B_PARAMETERS = 2_750_080


@pytest.fixture(scope="module")
def plan_70b():
    return plan_of("llama2-70b")


def test_llama2_70b_kv_is_320_kib_per_token_in_bf16(plan_70b):
    assert plan_70b.kv_bytes_per_token == 2 * 80 * 8 * 128 * 2 == 320 * 1024


def test_llama2_70b_per_gpu_bytes_by_hand(plan_70b):
    assert (plan_70b.strategy, plan_70b.world_size, plan_70b.batch_per_device) == ("fsdp", 8, 1)
    assert (plan_70b.context_length, plan_70b.continuation_length) == (3584, 512)  # the curriculum's last stages
    assert plan_70b.base_parameters == LLAMA2_70B_PARAMETERS
    assert plan_70b.estimator_parameters == ESTIMATOR_70B_PARAMETERS
    assert plan_70b.weight_bytes == LLAMA2_70B_PARAMETERS * 2 // 8  # bf16, sharded over 8 GPUs: 16.06 GiB
    assert plan_70b.kv_capture_bytes == 320 * 1024 * 3584  # 1.09 GiB at batch 1
    assert plan_70b.estimator_optimizer_bytes == ESTIMATOR_70B_PARAMETERS * 4 * 4 // 8
    assert plan_70b.tokens_per_step == 8 * (3584 + 512) and plan_70b.continuation_tokens_per_step == 8 * 512
    # gathered: embeddings + head + final norm, and one decoder layer, in bf16
    layer = 2 * 8192 * 8192 + 2 * 8192 * 1024 + 3 * 8192 * 28672 + 2 * 8192
    root = 2 * 32000 * 8192 + 8192
    assert plan_70b.gathered_weight_bytes == (root + layer) * 2
    assert plan_70b.activation_checkpointing
    checkpointed_inputs = 80 * 512 * 8192 * 2
    one_layer = 512 * (4 * 8192 + 3 * 28672) * 2 + 64 * 512 * 4  # fused kernel: one log-sum-exp per row
    estimator = 80 * 8 * 3584 * (128 // 4 + 2) * 4
    kl_chunk = 2 * 64 * 32000 * 4
    assert plan_70b.activation_bytes == checkpointed_inputs + one_layer + estimator + kl_chunk
    assert plan_70b.total_bytes < 80 * 2**30


def test_more_nodes_shard_further_and_double_the_tokens():
    plan = plan_of("llama2-70b", ["--trainer.num_nodes=2"])
    assert plan.world_size == 16 and plan.weight_bytes == LLAMA2_70B_PARAMETERS * 2 // 16
    assert plan.tokens_per_step == 16 * 4096


def test_reference_attention_path_keeps_the_probabilities(plan_70b):
    plan = plan_of("llama2-70b", ["--model.backend=torch"])
    assert plan.activation_bytes - plan_70b.activation_bytes == 64 * 512 * (4096 - 1) * 4


def test_llama2_7b_replicates_under_ddp():
    plan = plan_of("llama2-7b")
    assert (plan.strategy, plan.activation_checkpointing) == ("ddp", False)
    assert plan.weight_bytes == 6_738_415_616 * 2 and plan.gathered_weight_bytes == 0
    assert plan.kv_bytes_per_token == 2 * 32 * 32 * 128 * 2
    assert plan.estimator_optimizer_bytes == 4_400_128 * 16


def test_cli_prints_a_table_and_json(capsys):
    assert main(["plan", "--recipe", "llama2-70b", "--json", "true", "--batch_size", "2"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["kv_capture_bytes"] == 2 * 320 * 1024 * 3584 and record["tokens_per_step"] == 2 * 8 * 4096
    assert main(["plan", "--recipe", "llama2-70b"]) == 0
    table = capsys.readouterr().out
    assert "320.00 KiB" in table and "16.06 GiB" in table and "sharded over 8 GPUs (fsdp)" in table


def test_unknown_recipe_is_one_line(capsys):
    assert main(["plan", "--recipe", "llama-3"]) == 2
    assert capsys.readouterr().err.startswith("curkv-train: error: unknown recipe 'llama-3'")


def test_devices_from_the_command_line_are_planned_for(capsys):
    assert main(["plan", "--recipe", "llama2-70b", "--devices", "4", "--json", "true"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["devices"] == 4 and record["world_size"] == 4 and record["tokens_per_step"] == 4 * 4096


@pytest.mark.parametrize(("flag", "value"), [("--batch_size", "0"), ("--devices", "0"), ("--num_nodes", "-1")])
def test_counts_below_one_are_one_line(capsys, flag, value):
    assert main(["plan", "--recipe", "llama2-70b", flag, value]) == 2
    err = capsys.readouterr().err
    assert err.startswith("curkv-train: error: the recipe's ") and f"pass {flag} N (N >= 1)" in err
    assert len(err.strip().splitlines()) == 1


def test_a_hybrid_base_scores_its_full_attention_layers_only():
    gemma = plan_of("gemma3-270m")
    assert (gemma.compressed_layers, gemma.sliding_layers, gemma.sliding_window) == (3, 15, 512)
    assert gemma.kv_bytes_per_token == 2 * 18 * 1 * 256 * 4  # the capture holds every layer's context
    smollm2 = plan_of("smollm2-135m")
    assert (smollm2.compressed_layers, smollm2.sliding_layers, smollm2.sliding_window) == (30, 0, None)
