"""``curkv-train plan --recipe NAME``: parameters, bytes per GPU and tokens per step of a recipe, without running it.

The base model is built on the meta device from its config (shipped for the Llama-2
recipes), so the numbers come from the real module shapes. Per GPU, for the recipe's
strategy, devices, nodes, per-device batch and the curriculum's longest stage
(N context + M continuation tokens, batch b, base dtype of s bytes):

- weights: base parameters × s, divided by the world size under FSDP full shard,
  replicated under DDP; FSDP also holds the gathered root unit (embeddings, head,
  final norm: gathered for the whole step) and one gathered decoder layer.
- KV capture: 2 × layers × kv_heads × head_dim × s × N × b.
- activations of the continuation's backward, with one layer's internals
  A = b × M × (4·hidden + 3·intermediate) × s (q, k, v, o, MLP)
    + b × heads × M × (N + M) × 4 with ``model.backend: torch`` (the reference path keeps
      the fp32 attention probabilities), else b × heads × M × 4 (the fused kernel keeps
      one log-sum-exp per query row):
  with activation checkpointing on decoder layers (the FSDP recipe)
      layers × b × M × hidden × s (each layer's checkpointed input) + A (one layer recomputed),
  without it (DDP) layers × (b × M × hidden × s + A); both
  + compressed layers × b × kv_heads × N × a × 4 (estimator over the layers it scores, every layer but a hybrid
    base's sliding-window ones; a = its ``activation_floats()``: d / hidden_divisor + 2
    for the seed)
  + 2 × kl_chunk_size × b × vocab × 4 (teacher and student logits of one KL chunk).
- estimator + AdamW: parameters × 4 bytes × 4 (fp32 weights, grads, two moments),
  divided by the world size under FSDP.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import torch

from curkv_train.core.errors import CurKVError

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
FP32 = 4


@dataclass
class Plan:
    """Sizes of one recipe's training step; bytes are per GPU unless named otherwise."""

    recipe: str
    base_model: str
    strategy: str
    devices: int
    num_nodes: int
    world_size: int
    batch_per_device: int
    context_length: int
    continuation_length: int
    base_dtype: str
    base_parameters: int
    estimator_parameters: int
    kv_bytes_per_token: int
    weight_bytes: int
    gathered_weight_bytes: int
    kv_capture_bytes: int
    activation_bytes: int
    estimator_optimizer_bytes: int
    total_bytes: int
    activation_checkpointing: bool
    compressed_layers: int
    sliding_layers: int
    sliding_window: int | None
    tokens_per_step: int
    continuation_tokens_per_step: int


def strategy_kind(strategy) -> str:
    """``fsdp``, ``ddp`` or ``single`` for a trainer.strategy value (a name or a class_path config)."""
    name = strategy if isinstance(strategy, str) else getattr(strategy, "class_path", type(strategy).__name__)
    lowered = str(name).lower()
    if "fsdp" in lowered:
        return "fsdp"
    if "ddp" in lowered:
        return "ddp"
    return "single"


def activation_checkpointing(strategy) -> bool:
    """Whether a trainer.strategy config turns on Lightning's activation checkpointing (FSDP)."""
    init_args = getattr(strategy, "init_args", None)
    return bool(init_args is not None and (getattr(init_args, "activation_checkpointing_policy", None)
                                           or getattr(init_args, "activation_checkpointing", None)))


def longest_stage(config) -> tuple[int, int]:
    """(context, continuation) tokens of the longest curriculum stage, or of the data section without one."""
    context, continuation = config.data.context_length, config.data.continuation_length
    longest = (context, continuation)
    for callback in config.trainer.callbacks or []:
        if not str(getattr(callback, "class_path", "")).endswith(".Curriculum"):
            continue
        for stage in callback.init_args.stages:
            stage = stage if isinstance(stage, dict) else vars(stage)
            context = stage.get("context_length") or context
            continuation = stage.get("continuation_length") or continuation
            if context + continuation > sum(longest):
                longest = (context, continuation)
    return longest


def _count(tensors) -> int:
    return sum(tensor.numel() for tensor in tensors)


def _as_int(value, name: str) -> int:
    """A positive count from the recipe (``--trainer.devices=4`` arrives as the string "4"), else a CurKVError."""
    if isinstance(value, str) and value.isdigit():
        value = int(value)
    if isinstance(value, int) and value > 0:
        return value
    raise CurKVError(f"the recipe's {name} is {value!r}; pass --{name.split('.')[-1]} N (N >= 1) to plan for N")


def compute_plan(recipe: str, config) -> Plan:
    """Build the base of ``recipe`` (its resolved ``fit`` config, as the CLI parses it) on the meta device
    and size one training step (see the module docstring)."""
    from curkv_train.models.configs import build_meta_model, kv_shape, load_model_config
    from curkv_train.models.families import build_estimator
    from curkv_train.runtime.hybrid import sliding_layers

    model_hp, trainer = config.model, config.trainer
    model_config = load_model_config(model_hp.base_model)
    dtype_name = model_hp.base_dtype
    dtype_bytes = DTYPE_BYTES[dtype_name]
    base = build_meta_model(model_config, dtype=getattr(torch, dtype_name))
    shape = kv_shape(model_config)
    estimator = build_estimator(model_hp.estimator, shape, **(model_hp.estimator_options or {}))

    kind = strategy_kind(trainer.strategy)
    devices, nodes = _as_int(trainer.devices, "trainer.devices"), _as_int(trainer.num_nodes, "trainer.num_nodes")
    world = devices * nodes
    batch = _as_int(config.data.batch_size, "data.batch_size")
    context, continuation = longest_stage(config)

    base_parameters = _count(base.parameters())
    layers = base.model.layers
    layer_parameters = _count(layers[0].parameters())
    root_parameters = base_parameters - _count(layers.parameters())
    estimator_parameters = _count(estimator.parameters())
    sliding = len(sliding_layers(base))
    compressed = shape.num_layers - sliding  # a hybrid base's sliding-window layers are never scored

    sharded = kind == "fsdp"
    weight_bytes = base_parameters * dtype_bytes // (world if sharded else 1)
    gathered = (root_parameters + layer_parameters) * dtype_bytes if sharded else 0
    kv_per_token = 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * dtype_bytes
    kv_capture = kv_per_token * context * batch
    hidden, intermediate = model_config.hidden_size, model_config.intermediate_size
    layer_input = batch * continuation * hidden * dtype_bytes
    attended = context + continuation if model_hp.backend == "torch" else 1
    layer_internal = (batch * continuation * (4 * hidden + 3 * intermediate) * dtype_bytes
                      + batch * shape.num_attention_heads * continuation * attended * FP32)
    checkpointed = activation_checkpointing(trainer.strategy)
    layers_saved = shape.num_layers * layer_input + (1 if checkpointed else shape.num_layers) * layer_internal
    activations = (layers_saved
                   + compressed * batch * shape.num_kv_heads * context
                   * estimator.activation_floats() * FP32
                   + 2 * model_hp.kl_chunk_size * batch * model_config.vocab_size * FP32)
    optimizer = estimator_parameters * FP32 * 4 // (world if sharded else 1)
    total = weight_bytes + gathered + kv_capture + activations + optimizer
    return Plan(recipe, model_hp.base_model, kind, devices, nodes, world, batch, context, continuation, dtype_name,
                base_parameters, estimator_parameters, kv_per_token, weight_bytes, gathered, kv_capture,
                activations, optimizer, total, checkpointed, compressed, sliding,
                getattr(model_config, "sliding_window", None) if sliding else None,
                world * batch * (context + continuation), world * batch * continuation)


def human_bytes(count: int) -> str:
    """``count`` bytes in binary units (KiB, MiB, GiB)."""
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:.2f} TiB"


def format_plan(plan: Plan) -> str:
    """A readable table of ``plan``."""
    layout = "sharded over" if plan.strategy == "fsdp" else "replicated on"
    rows = [
        ("base parameters", f"{plan.base_parameters:,}", f"{plan.base_model}, {plan.base_dtype}"),
        ("estimator parameters", f"{plan.estimator_parameters:,}", "fp32"),
        ("KV bytes per token", human_bytes(plan.kv_bytes_per_token), "2 x layers x kv_heads x head_dim x dtype"),
        ("compressed layers", f"{plan.compressed_layers}", "every layer" if not plan.sliding_layers else
         f"full-attention only: {plan.sliding_layers} sliding-window layers (window {plan.sliding_window}) keep "
         "their window, uncompressed"),
        ("weights / GPU", human_bytes(plan.weight_bytes), f"{layout} {plan.world_size} GPUs ({plan.strategy})"),
        ("gathered units / GPU", human_bytes(plan.gathered_weight_bytes), "FSDP only: root + one decoder layer"),
        ("KV capture / GPU", human_bytes(plan.kv_capture_bytes), f"{plan.context_length} context tokens x "
                                                                 f"batch {plan.batch_per_device}"),
        ("activations / GPU", human_bytes(plan.activation_bytes),
         f"{plan.continuation_length} continuation tokens, "
         + ("checkpointed decoder layers" if plan.activation_checkpointing else "no activation checkpointing")),
        ("estimator + AdamW / GPU", human_bytes(plan.estimator_optimizer_bytes), "fp32 params, grads, 2 moments"),
        ("total / GPU (estimate)", human_bytes(plan.total_bytes), "before allocator overhead"),
        ("tokens per step", f"{plan.tokens_per_step:,}", f"{plan.world_size} GPUs x batch {plan.batch_per_device} "
                                                         f"x ({plan.context_length} + {plan.continuation_length})"),
        ("continuation tokens / step", f"{plan.continuation_tokens_per_step:,}", "tokens the KL is measured on"),
    ]
    header = (f"plan for recipe {plan.recipe}: {plan.strategy} on {plan.num_nodes} node(s) x {plan.devices} "
              f"device(s), longest stage {plan.context_length} + {plan.continuation_length} tokens")
    widths = [max(len(row[column]) for row in rows) for column in range(2)]
    lines = [header] + [f"  {name:<{widths[0]}}  {value:>{widths[1]}}  {note}" for name, value, note in rows]
    return "\n".join(lines)


def plan_json(plan: Plan) -> str:
    """``plan`` as a JSON object."""
    return json.dumps(asdict(plan), indent=2)
