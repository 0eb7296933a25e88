"""CurKVModule: the LightningModule that distills the value estimator (DESIGN §1, §4)."""

from __future__ import annotations

import dataclasses
import math

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import rank_zero_warn
from torchmetrics import MeanMetric

from curkv_train.training.scored_attention import CompressionState, full_attention_layers, patch_model
from curkv_train.core.rope import KEY_VIEWS
from curkv_train.core.selection import check_allocation, check_head_floor, check_keep_ratio, compressible_mask
from curkv_train.core.shapes import kv_shape
from curkv_train.training.distributed import clip_grad_norm, prepare_rank_zero_loading, saves_sharded_checkpoints
from curkv_train.core.errors import CurKVError
from curkv_train.kernels import BACKENDS
from curkv_train.models.base import load_base_model, load_tokenizer
from curkv_train.training.capture import (ContextCapture, continue_from, estimator_inputs, prefill_context,
                                        reconstruction_target)
from curkv_train.models.families import build_estimator, check_family
from curkv_train.training.objective import (EVICTED_WEIGHT, BudgetController, KeepRatio, TrainingSettings, budget_keep,
                                            chunked_kl, dense_loss, keep_bias, streaming_ends, streaming_keep_bias)
from curkv_train.training.reconstruction import RECONSTRUCTION_PROMPT
from curkv_train.runtime.allocation import LayerBudget

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
BASE_INITS = ("every_rank", "rank_zero")
SETTINGS_KEY = "curkv_training_settings"
LAYER_BUDGET_KEY = "curkv_layer_budget"


class CurKVModule(L.LightningModule):
    """Trains a value estimator against a frozen LLM by distillation.

    Only estimator parameters are optimized and checkpointed; the base model is
    loaded in :meth:`configure_model` (so strategies such as FSDP can shard it).

    Only full-attention layers are compressed (a hybrid model's sliding-window layers attend as the plain
    model does): the estimator keeps a row per layer, but the biases, the budget term, the dense target and
    the allocation read the rows of :attr:`full_layers` only.

    Args:
        base_model: hub id, local folder, ``embedded:NAME`` or a tiny random model (``tiny-random-llama``,
            ``tiny-random-gemma3``, ``tiny-random-qwen3``).
        base_fallback: loaded instead when ``base_model`` is unreachable.
        base_dtype: float32, bfloat16 or float16 for the frozen base.
        estimator: the estimator family: seed, query_aware or hidden.
        estimator_options: the family's other constructor arguments (e.g. ``init_keep``,
            ``hidden_divisor``; ``observation_window``, ``init_rule`` for query_aware;
            ``hidden_units`` for hidden).
        n_sink: leading context tokens always kept (attention sinks).
        window: trailing context tokens always kept (recent window).
        keep_ratio: target ρ = kept / compressible tokens (validation always measures this one).
        temperature: score temperature T in s = σ(z / T).
        hard_topk: train on the exact top-⌈ρ·n⌉ mask (straight-through gradients).
        allocation: per_head (the hard mask keeps ⌈ρ·n⌉ in every layer and KV head) or joint (⌈ρ·N⌉ over all
            layers and KV heads of an example, by score, each head keeping at least its floor; the budget term
            then holds the mean keep over everything at ρ). Not with a layer budget.
        head_floor: with joint, the share of its ⌈ρ·n⌉ every head keeps whatever the others score, in [0, 1].
        budget_mode: two_sided, hinge or lagrange (see BudgetController).
        budget_weight: λ of the budget penalty.
        dual_lr: dual ascent step for the lagrange budget.
        hidden_mse_weight: μ of the optional last-hidden-state MSE.
        dense_weight: weight of the dense ranking term against the reconstruction target
            (:mod:`curkv_train.training.reconstruction`); 0 skips the reconstruction pass outside warm start.
        kl_chunk_size: tokens per vocabulary-logit chunk of the KL.
        key_view: pre_rope, end_relative or post_rope keys for the estimator.
        backend: compression kernel backend (auto, torch, triton).
        learning_rate, weight_decay: AdamW settings.
        base_init: every_rank (each process reads the base weights) or rank_zero (only global
            rank 0 reads them, the others build the base on the meta device and FSDP broadcasts
            rank 0's weights while sharding; FSDP only).
        init_scorer: an exported scorer folder (``checkpoints/NAME``) whose weights start the
            estimator (curriculum fine-tuning); its base-model fingerprint must match.
        layer_budget: an exported scorer folder whose calibrated layer budget (``curkv-train calibrate``)
            splits every step's ρ across layers, as CurKVCache and the evaluation split it at inference
            (None: every layer at ρ). The export carries the budget trained under.
    """

    def __init__(self, base_model: str = "tiny-random-llama", base_fallback: str | None = None,
                 base_dtype: str = "float32", estimator: str = "seed", estimator_options: dict | None = None,
                 n_sink: int = 4, window: int = 64, keep_ratio: float = 0.5, temperature: float = 1.0,
                 hard_topk: bool = False, budget_mode: str = "two_sided", budget_weight: float = 0.4,
                 dual_lr: float = 0.05, hidden_mse_weight: float = 0.0, dense_weight: float = 0.0,
                 kl_chunk_size: int = 64, key_view: str = "pre_rope", backend: str = "auto",
                 learning_rate: float = 1e-3, weight_decay: float = 0.0, base_init: str = "every_rank",
                 init_scorer: str | None = None, layer_budget: str | None = None, allocation: str = "per_head",
                 head_floor: float = 0.1) -> None:
        super().__init__()
        self.save_hyperparameters()
        check_keep_ratio(keep_ratio)
        check_family(estimator)
        for name, value, allowed in (("key_view", key_view, KEY_VIEWS), ("backend", backend, BACKENDS),
                                     ("base_dtype", base_dtype, DTYPES), ("base_init", base_init, BASE_INITS)):
            if value not in allowed:
                raise CurKVError(f"unknown {name} {value!r}; expected one of {', '.join(allowed)}")
        self.settings = TrainingSettings(keep_ratio, temperature, hard_topk, budget_weight, allocation=allocation,
                                         head_floor=head_floor)
        self.check_settings(self.settings)
        self.base = None
        self.full_layers: list[int] = []
        self.estimator = None
        self.budget: BudgetController | None = None
        self.layer_budget: LayerBudget | None = None
        self.reconstruction_prompt: torch.Tensor | None = None
        self.strict_loading = False  # checkpoints hold the estimator only, never the frozen base
        self.val_metrics = torch.nn.ModuleDict({name: MeanMetric() for name in ("kl_soft", "kl_hard", "kl_recent")})

    def apply_stage(self, settings: TrainingSettings) -> None:
        """Use ``settings`` from the next step on (the curriculum calls this)."""
        self.check_settings(settings)
        self.settings = settings

    def check_settings(self, settings: TrainingSettings) -> None:
        """A CurKVError for settings no context length can train: a ratio outside (0, 1], an unknown allocation,
        a head floor outside [0, 1], or the joint allocation with a layer budget."""
        check_keep_ratio(settings.keep_ratio)
        check_allocation(settings.allocation)
        check_head_floor(settings.head_floor)
        if settings.allocation != "joint":
            return
        if self.hparams.layer_budget:
            raise CurKVError("allocation joint chooses each layer's share itself; drop model.layer_budget "
                             "or train with allocation per_head")

    def configure_model(self) -> None:
        """Load the frozen base, patch its attention, and build the estimator for its shapes."""
        if self.base is not None:
            return
        hp = self.hparams
        self.base = patch_model(self.load_base())
        # The frozen base is identical on every rank: DDP need not broadcast it (only estimator grads are reduced).
        self._ddp_params_and_buffers_to_ignore = [f"base.{name}" for name, _ in self.base.named_parameters()]
        self._ddp_params_and_buffers_to_ignore += [f"base.{name}" for name, _ in self.base.named_buffers()]
        shape = kv_shape(self.base.config)
        self.full_layers = full_attention_layers(self.base.config)
        self.estimator = build_estimator(hp.estimator, shape, **(hp.estimator_options or {}))
        self.budget = BudgetController(len(self.full_layers), shape.num_kv_heads, mode=hp.budget_mode,
                                       dual_lr=hp.dual_lr)
        if hp.init_scorer:
            self.load_init_scorer(hp.init_scorer)
        if hp.layer_budget:
            if len(self.full_layers) < shape.num_layers:
                raise CurKVError("a layer budget on a hybrid base (sliding-window layers) is not supported, as the "
                                 "runtime does not support it; drop model.layer_budget")
            self.layer_budget = self.load_layer_budget(hp.layer_budget)

    def load_base(self):
        """The frozen base per ``base_init``: loaded here, or (rank_zero, rank > 0) an empty meta skeleton."""
        hp = self.hparams
        dtype = DTYPES[hp.base_dtype]
        if hp.base_init == "rank_zero" and self._trainer is not None:
            prepare_rank_zero_loading(self.trainer.strategy)
            if self.global_rank != 0:
                from curkv_train.models.configs import build_meta_model, load_model_config

                return build_meta_model(load_model_config(hp.base_model), dtype=dtype)
        return load_base_model(hp.base_model, fallback=hp.base_fallback, dtype=dtype)

    def load_init_scorer(self, path: str) -> None:
        """Start the estimator from an exported scorer (its base fingerprint must match this base)."""
        from curkv_train.runtime import load_scorer

        scorer = load_scorer(path, model=self.base)
        if (scorer.family, scorer.estimator.config()) != (self.estimator.family, self.estimator.config()):
            raise CurKVError(f"scorer {path} has a {scorer.family} estimator {scorer.estimator.config()}, this run "
                             f"builds a {self.estimator.family} one {self.estimator.config()}; match model.estimator "
                             "and model.estimator_options or drop init_scorer")
        if scorer.key_view != self.hparams.key_view:
            raise CurKVError(f"scorer {path} was trained on {scorer.key_view} keys, this run uses "
                             f"{self.hparams.key_view}; set model.key_view: {scorer.key_view}")
        with torch.no_grad():
            for name, tensor in scorer.estimator.state_dict().items():
                self.estimator.state_dict()[name].copy_(tensor)

    def load_layer_budget(self, path: str) -> LayerBudget:
        """The calibrated layer budget of an exported scorer for this base; a one-line error if it has none."""
        from curkv_train.runtime import load_scorer

        budget = load_scorer(path, model=self.base).layer_budget
        if budget is None:
            raise CurKVError(f"scorer {path} has no layer budget: run curkv-train calibrate --scorer {path} first, "
                             "or drop model.layer_budget")
        return budget

    def layer_ratios(self, keep_ratio: float) -> KeepRatio:
        """ρ for every layer, or with a layer budget its split into ρ_l per layer (mean ρ; never on a hybrid base)."""
        return keep_ratio if self.layer_budget is None else self.layer_budget.ratios(keep_ratio)

    def full_rows(self, per_layer: torch.Tensor) -> torch.Tensor:
        """The rows of ``per_layer`` (layers, ...) that belong to full-attention layers, (full layers, ...)."""
        if len(self.full_layers) == per_layer.shape[0]:
            return per_layer
        return per_layer[torch.tensor(self.full_layers, device=per_layer.device)]

    def layer_biases(self, bias: torch.Tensor) -> list[torch.Tensor | None]:
        """Per model layer, the bias (batch, kv_heads, context) of ``bias`` (full layers, batch, kv_heads,
        context), None for a sliding-window layer (never compressed)."""
        rows = dict(zip(self.full_layers, bias))
        return [rows.get(layer) for layer in range(kv_shape(self.base.config).num_layers)]

    def capture_context(self, input_ids: torch.Tensor, context_length: int) -> ContextCapture:
        """Prefill the context without grad, recording the attention inputs if the estimator family reads them.

        Args:
            input_ids: (batch, context + continuation) token ids.
            context_length: tokens of the compressed context.
        """
        self.check_positions(input_ids.shape[1], "sequence")
        return prefill_context(self.base, input_ids[:, :context_length], record_hidden=bool(self.estimator.needs),
                               record_keys=self.hparams.key_view == "pre_rope")

    @torch.no_grad()
    def teacher_hidden(self, capture: ContextCapture, continuation: torch.Tensor) -> torch.Tensor:
        """Continuation hidden states (batch, M, hidden) over the full cache, no grad."""
        state = CompressionState("full", capture.context_length, backend=self.hparams.backend)
        return continue_from(self.base, capture, continuation, state)

    def check_positions(self, tokens: int, what: str) -> None:
        """A CurKVError if ``tokens`` positions exceed the base model's position limit."""
        positions = self.base.config.max_position_embeddings
        if tokens > positions:
            raise CurKVError(f"{what} of {tokens} tokens exceeds the model's {positions} positions")

    def check_stage(self, settings: TrainingSettings, context_length: int) -> None:
        """A CurKVError if ``settings`` cannot train on ``context_length``-token contexts.

        Streaming rounds must each leave tokens to compete (the first round's end past the sinks
        and hot tier), and the reconstruction pass (warm start or ``dense_weight``: context,
        prompt, context again) must fit the base's positions.
        """
        hp = self.hparams
        self.check_settings(settings)
        if settings.streaming_rounds:
            stride = settings.compress_every * hp.window
            first = streaming_ends(context_length, settings.streaming_rounds, stride)[0]
            protected = hp.n_sink + settings.hot_windows * hp.window
            if first <= protected:
                raise CurKVError(f"{settings.streaming_rounds} streaming rounds {stride} tokens apart start at token "
                                 f"{first} of a {context_length}-token context, not past the {protected} sink and hot "
                                 "tokens: use fewer rounds, a smaller compress_every or hot_windows, or longer contexts")
        if settings.warm_start or hp.dense_weight:
            self.check_positions(2 * context_length + len(self.prompt_ids()), "the reconstruction pass")

    def prompt_ids(self) -> torch.Tensor:
        """(prompt,) token ids of the reconstruction instruction, tokenized once."""
        if self.reconstruction_prompt is None:
            tokenizer = load_tokenizer(self.hparams.base_model, fallback=self.hparams.base_fallback)
            ids = tokenizer(RECONSTRUCTION_PROMPT, add_special_tokens=False)["input_ids"]
            self.reconstruction_prompt = torch.tensor(ids, dtype=torch.long)
        return self.reconstruction_prompt

    def dense_target(self, capture: ContextCapture) -> torch.Tensor:
        """Reconstruction scores (full layers, batch, kv_heads, context) of the context (the dense target)."""
        prompt = self.prompt_ids()
        self.check_positions(2 * capture.context_length + len(prompt), "the reconstruction pass")
        return reconstruction_target(self.base, capture, prompt, backend=self.hparams.backend)

    def compressible(self, capture: ContextCapture) -> torch.Tensor:
        """(context,) bool: the context tokens that compete for the budget."""
        hp = self.hparams
        return compressible_mask(capture.context_length, hp.n_sink, hp.window, device=capture.context_ids.device)

    def distill(self, capture: ContextCapture, continuation: torch.Tensor, teacher: torch.Tensor,
                settings: TrainingSettings, target: torch.Tensor | None = None) -> dict:
        """Student pass against the teacher: loss terms and keep statistics.

        Args:
            target: the dense target (full layers, batch, kv_heads, context), or None to leave its term out.
        """
        hp = self.hparams
        logits = self.full_rows(self.estimator(estimator_inputs(self.base, self.estimator, capture, hp.key_view)))
        compressible, ratios = self.compressible(capture), self.layer_ratios(settings.keep_ratio)
        if settings.streaming_rounds:
            bias, scores = self.streaming_bias(capture, logits, settings, ratios)
        else:
            bias, scores = keep_bias(logits, compressible, temperature=settings.temperature, keep_ratio=ratios,
                                     hard=settings.hard_topk, allocation=settings.allocation,
                                     head_floor=settings.head_floor)
        student = self.student_hidden(capture, continuation, bias)
        kl = chunked_kl(teacher, student, self.base.get_output_embeddings(), hp.kl_chunk_size)
        mean_keep = budget_keep(scores, settings.allocation)
        budget = (self.budget(mean_keep, ratios, settings.budget_weight) if settings.keep_ratio < 1
                  else kl.new_zeros(()))
        mse = F.mse_loss(student.float(), teacher.float()) if hp.hidden_mse_weight else kl.new_zeros(())
        dense = dense_loss(logits, target, compressible) if target is not None else kl.new_zeros(())
        loss = kl + budget + hp.hidden_mse_weight * mse + hp.dense_weight * dense
        kept = kept_share(bias, compressible) if settings.hard_topk and not settings.streaming_rounds else None
        return {"loss": loss, "kl": kl, "budget": budget, "hidden_mse": mse, "dense": dense, "mean_keep": mean_keep,
                "scores": scores.detach(), "kept_layer": kept}

    def streaming_bias(self, capture: ContextCapture, logits: torch.Tensor, settings: TrainingSettings,
                       ratios: KeepRatio) -> tuple[torch.Tensor, torch.Tensor]:
        """Biases of the context compressed in ``settings.streaming_rounds`` rounds ``compress_every`` windows apart,
        each scored at its own end (:func:`~curkv_train.training.objective.streaming_keep_bias`) and kept at ``ratios``
        (:meth:`layer_ratios` of the step's ρ); ``logits`` (full layers, batch, kv_heads, context) are the last
        round's."""
        hp = self.hparams
        ends = streaming_ends(capture.context_length, settings.streaming_rounds, settings.compress_every * hp.window)
        round_logits = [self.full_rows(self.estimator(estimator_inputs(self.base, self.estimator, capture,
                                                                       hp.key_view, end=end)))
                        for end in ends[:-1]] + [logits]
        return streaming_keep_bias(round_logits, ends, n_sink=hp.n_sink, hot=settings.hot_windows * hp.window,
                                   temperature=settings.temperature, keep_ratio=ratios, hard=settings.hard_topk,
                                   recent_share=settings.recent_share, count_protected=settings.count_protected,
                                   allocation=settings.allocation, head_floor=settings.head_floor)

    def warm_start_loss(self, capture: ContextCapture, target: torch.Tensor) -> torch.Tensor:
        """The dense ranking term alone (warm start: no continuation, no backward through the LLM)."""
        logits = self.estimator(estimator_inputs(self.base, self.estimator, capture, self.hparams.key_view))
        return dense_loss(self.full_rows(logits), target, self.compressible(capture))

    def student_hidden(self, capture: ContextCapture, continuation: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """Continuation hidden states (batch, M, hidden) with ``bias`` (full layers, batch, kv_heads, context)."""
        state = CompressionState("scored", capture.context_length, self.layer_biases(bias), self.hparams.backend)
        return continue_from(self.base, capture, continuation, state)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        ids, length, settings = batch["input_ids"], batch["context_length"], self.settings
        size = ids.shape[0]
        capture = self.capture_context(ids, length)
        target = self.dense_target(capture) if settings.warm_start or self.hparams.dense_weight else None
        self._last_mean_keep = None
        if settings.warm_start:
            loss = self.warm_start_loss(capture, target)
            self.log("train/warm_start", loss, prog_bar=True, batch_size=size)
            return loss
        continuation = ids[:, length:]
        out = self.distill(capture, continuation, self.teacher_hidden(capture, continuation), settings, target)
        self._last_mean_keep = out["mean_keep"].detach()
        self.log_dict({"train/loss": out["loss"], "train/kl": out["kl"], "train/budget": out["budget"],
                       "train/mean_keep": out["mean_keep"].mean(), "train/keep_ratio": settings.keep_ratio},
                      prog_bar=True, batch_size=size)
        if self.hparams.hidden_mse_weight:
            self.log("train/hidden_mse", out["hidden_mse"], batch_size=size)
        if target is not None:
            self.log("train/dense", out["dense"], batch_size=size)
        effective = (out["scores"] > 0.5).float().mean(dim=(1, 2, 3))
        self.log_dict({f"keep_layer/{layer:02d}": value for layer, value in zip(self.full_layers, effective)},
                      batch_size=size)
        if out["kept_layer"] is not None:  # what the hard mask kept, where the allocation put it
            kept = zip(self.full_layers, out["kept_layer"])
            self.log_dict({f"kept_layer/{layer:02d}": value for layer, value in kept}, batch_size=size)
        return out["loss"]

    def on_train_batch_end(self, outputs, batch, batch_idx: int) -> None:
        if self._last_mean_keep is not None:
            self.budget.dual_step(self._last_mean_keep, self.layer_ratios(self.settings.keep_ratio))

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        """KL at the recipe's target ratio (not the curriculum's current one, so checks compare)."""
        ids, length = batch["input_ids"], batch["context_length"]
        capture = self.capture_context(ids, length)
        continuation = ids[:, length:]
        teacher = self.teacher_hidden(capture, continuation)
        target_settings = dataclasses.replace(self.settings, keep_ratio=self.hparams.keep_ratio)
        for name, hard in (("kl_soft", False), ("kl_hard", True)):
            out = self.distill(capture, continuation, teacher, dataclasses.replace(target_settings, hard_topk=hard))
            self.val_metrics[name].update(out["kl"])
        self.val_metrics["kl_recent"].update(self.recent_window_kl(capture, continuation, teacher,
                                                                   self.hparams.keep_ratio))
        self.log_dict({f"val/{name}": metric for name, metric in self.val_metrics.items()}, prog_bar=True,
                      batch_size=ids.shape[0])

    def recent_window_kl(self, capture: ContextCapture, continuation: torch.Tensor, teacher: torch.Tensor,
                         keep_ratio: float) -> torch.Tensor:
        """KL of keeping the most recent ⌈ρ·n⌉ compressible tokens (StreamingLLM; ρ_l under a layer budget)."""
        recency = capture.positions.float().expand(len(self.full_layers), *capture.values.shape[1:4])
        bias, _ = keep_bias(recency, self.compressible(capture), temperature=1.0,
                            keep_ratio=self.layer_ratios(keep_ratio), hard=True)
        student = self.student_hidden(capture, continuation, bias)
        return chunked_kl(teacher, student, self.base.get_output_embeddings(), self.hparams.kl_chunk_size)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.estimator.parameters(), lr=self.hparams.learning_rate,
                                 weight_decay=self.hparams.weight_decay)

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        """Lightning's clipping; under FSDP by the global norm over shards (Lightning leaves that to us)."""
        if gradient_clip_val and gradient_clip_algorithm in (None, "norm") and clip_grad_norm(
                self.trainer.strategy, gradient_clip_val):
            return
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        """Keep only the estimator and budget state, the settings of the last step and the layer budget.

        Exception: FSDP sharded checkpoints keep the base's shards, because Lightning resumes
        them through torch.distributed.checkpoint, which needs every key of the model.
        """
        checkpoint[SETTINGS_KEY] = dataclasses.asdict(self.settings)
        if self.layer_budget is not None:  # the numbers, and the scorer whose scorer.json says how they were measured
            checkpoint[LAYER_BUDGET_KEY] = {**self.layer_budget.record(), "source": self.hparams.layer_budget}
        if self._trainer is not None and saves_sharded_checkpoints(self.trainer.strategy):
            return
        checkpoint["state_dict"] = {key: value for key, value in checkpoint["state_dict"].items()
                                    if not key.startswith("base.")}

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        """Resume with the settings of the checkpoint's last step (the curriculum re-applies its own); a warning
        names the ones the command line or recipe set otherwise, which the resumed run does not take."""
        if SETTINGS_KEY in checkpoint:
            restored = TrainingSettings(**checkpoint[SETTINGS_KEY])
            given = dataclasses.asdict(self.settings)
            differing = {name: (value, given[name]) for name, value in dataclasses.asdict(restored).items()
                         if given[name] != value}
            if differing and not self._has_curriculum():
                rank_zero_warn("resuming with the checkpoint's training settings "
                               + ", ".join(f"{name} {old} (given: {new})" for name, (old, new) in differing.items())
                               + "; a curriculum stage can change them for a resumed run")
            self.settings = restored

    def _has_curriculum(self) -> bool:
        """Whether the trainer runs a curriculum (which sets the settings of every step itself)."""
        from curkv_train.training.callbacks.curriculum import Curriculum

        return self._trainer is not None and any(isinstance(callback, Curriculum) for callback in self.trainer.callbacks)


def kept_share(bias: torch.Tensor, compressible: torch.Tensor) -> torch.Tensor:
    """(layers,) share of each layer's compressible tokens a hard ``bias`` (layers, batch, kv_heads, context) keeps."""
    kept = bias.detach()[..., compressible] > math.log(EVICTED_WEIGHT) / 2
    return kept.float().mean(dim=(1, 2, 3))
