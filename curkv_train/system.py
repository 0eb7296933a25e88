"""CurKVModule: the LightningModule that distills the value estimator (DESIGN §1, §4)."""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
from torchmetrics import MeanMetric

from curkv_train.attention import CompressionState, patch_model
from curkv_train.distributed import clip_grad_norm, prepare_rank_zero_loading, saves_sharded_checkpoints
from curkv_train.errors import CurKVError
from curkv_train.kernels import BACKENDS
from curkv_train.models.base import load_base_model
from curkv_train.core.rope import KEY_VIEWS
from curkv_train.core.selection import check_keep_ratio, compressible_mask
from curkv_train.core.shapes import kv_shape
from curkv_train.models.capture import ContextCapture, continue_from, prefill_context
from curkv_train.models.estimator import ValueEstimator
from curkv_train.objective import BudgetController, chunked_kl, keep_bias

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
BASE_INITS = ("every_rank", "rank_zero")


class CurKVModule(L.LightningModule):
    """Trains a :class:`ValueEstimator` against a frozen LLM by distillation.

    Only estimator parameters are optimized and checkpointed; the base model is
    loaded in :meth:`configure_model` (so strategies such as FSDP can shard it).

    Args:
        base_model: hub id, local folder, ``embedded:NAME`` or ``tiny-random-llama``.
        base_fallback: loaded instead when ``base_model`` is unreachable.
        base_dtype: float32, bfloat16 or float16 for the frozen base.
        n_sink: leading context tokens always kept (attention sinks).
        window: trailing context tokens always kept (recent window).
        keep_ratio: target ρ = kept / compressible tokens.
        temperature: score temperature T in s = σ(z / T).
        hard_topk: train on the exact top-⌈ρ·n⌉ mask (straight-through gradients).
        budget_mode: two_sided, hinge or lagrange (see BudgetController).
        budget_weight: λ of the budget penalty.
        dual_lr: dual ascent step for the lagrange budget.
        hidden_mse_weight: μ of the optional last-hidden-state MSE.
        kl_chunk_size: tokens per vocabulary-logit chunk of the KL.
        key_view: pre_rope, end_relative or post_rope keys for the estimator.
        backend: compression kernel backend (auto, torch, triton).
        hidden_divisor: the estimator's value MLP is d -> d / hidden_divisor -> 1.
        init_keep: the estimator's initial keep score.
        learning_rate, weight_decay: AdamW settings.
        base_init: every_rank (each process reads the base weights) or rank_zero (only global
            rank 0 reads them, the others build the base on the meta device and FSDP broadcasts
            rank 0's weights while sharding; FSDP only).
        init_scorer: an exported scorer folder (``checkpoints/NAME``) whose weights start the
            estimator (curriculum fine-tuning); its base-model fingerprint must match.
    """

    def __init__(self, base_model: str = "tiny-random-llama", base_fallback: str | None = None,
                 base_dtype: str = "float32", n_sink: int = 4, window: int = 64, keep_ratio: float = 0.5,
                 temperature: float = 1.0, hard_topk: bool = False, budget_mode: str = "two_sided",
                 budget_weight: float = 0.4, dual_lr: float = 0.05, hidden_mse_weight: float = 0.0,
                 kl_chunk_size: int = 64, key_view: str = "pre_rope", backend: str = "auto",
                 hidden_divisor: int = 4, init_keep: float = 0.5, learning_rate: float = 1e-3,
                 weight_decay: float = 0.0, base_init: str = "every_rank",
                 init_scorer: str | None = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        check_keep_ratio(keep_ratio)
        if key_view not in KEY_VIEWS:
            raise CurKVError(f"unknown key_view {key_view!r}; expected one of {', '.join(KEY_VIEWS)}")
        if backend not in BACKENDS:
            raise CurKVError(f"unknown backend {backend!r}; expected one of {', '.join(BACKENDS)}")
        if base_dtype not in DTYPES:
            raise CurKVError(f"unknown base_dtype {base_dtype!r}; expected one of {', '.join(DTYPES)}")
        if base_init not in BASE_INITS:
            raise CurKVError(f"unknown base_init {base_init!r}; expected one of {', '.join(BASE_INITS)}")
        self.keep_ratio, self.temperature, self.hard_topk = keep_ratio, temperature, hard_topk
        self.budget_weight = budget_weight
        self.warm_start = False  # set by the curriculum's stage 0
        self.base = None
        self.estimator: ValueEstimator | None = None
        self.budget: BudgetController | None = None
        self.strict_loading = False  # checkpoints hold the estimator only, never the frozen base
        self.val_metrics = torch.nn.ModuleDict({name: MeanMetric() for name in ("kl_soft", "kl_hard", "kl_recent")})

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
        self.estimator = ValueEstimator(shape.num_layers, shape.num_kv_heads, shape.head_dim,
                                        hidden_divisor=hp.hidden_divisor, max_positions=shape.max_positions,
                                        init_keep=hp.init_keep)
        self.budget = BudgetController(shape.num_layers, shape.num_kv_heads, mode=hp.budget_mode, dual_lr=hp.dual_lr)
        if hp.init_scorer:
            self.load_init_scorer(hp.init_scorer)

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
        if scorer.estimator.config() != self.estimator.config():
            raise CurKVError(f"scorer {path} has estimator {scorer.estimator.config()}, this run builds "
                             f"{self.estimator.config()}; match model.hidden_divisor / init_keep or drop init_scorer")
        if scorer.key_view != self.hparams.key_view:
            raise CurKVError(f"scorer {path} was trained on {scorer.key_view} keys, this run uses "
                             f"{self.hparams.key_view}; set model.key_view: {scorer.key_view}")
        with torch.no_grad():
            for name, tensor in scorer.estimator.state_dict().items():
                self.estimator.state_dict()[name].copy_(tensor)

    def teacher_pass(self, input_ids: torch.Tensor, context_length: int, capture_attention: bool = False):
        """Prefill the context and run the full-cache teacher over the continuation, no grad.

        Args:
            input_ids: (batch, context + continuation) token ids.
            context_length: tokens of the compressed context.

        Returns:
            (capture, continuation ids (batch, M), teacher hidden states (batch, M, hidden)).
        """
        positions = self.base.config.max_position_embeddings
        if input_ids.shape[1] > positions:
            raise CurKVError(f"sequence of {input_ids.shape[1]} tokens exceeds the model's {positions} positions")
        capture = prefill_context(self.base, input_ids[:, :context_length], self.hparams.key_view)
        continuation = input_ids[:, context_length:]
        state = CompressionState("capture" if capture_attention else "full", context_length,
                                 backend=self.hparams.backend)
        with torch.no_grad():
            teacher = continue_from(self.base, capture, continuation, state)
        capture.attention_mass = state.attention_mass
        return capture, continuation, teacher

    def distill(self, capture: ContextCapture, continuation: torch.Tensor, teacher: torch.Tensor, *,
                keep_ratio: float, hard: bool) -> dict:
        """Student pass against the teacher: loss terms and keep statistics."""
        hp = self.hparams
        logits = self.estimator(capture.keys, capture.values, capture.positions, capture.context_length)
        compressible = compressible_mask(capture.context_length, hp.n_sink, hp.window, device=continuation.device)
        bias, scores = keep_bias(logits, compressible, temperature=self.temperature, keep_ratio=keep_ratio, hard=hard)
        student = self.student_hidden(capture, continuation, bias)
        kl = chunked_kl(teacher, student, self.base.get_output_embeddings(), hp.kl_chunk_size)
        mean_keep = scores.mean(dim=(1, 3))
        budget = self.budget(mean_keep, keep_ratio, self.budget_weight) if keep_ratio < 1 else kl.new_zeros(())
        mse = F.mse_loss(student.float(), teacher.float()) if hp.hidden_mse_weight else kl.new_zeros(())
        loss = kl + budget + hp.hidden_mse_weight * mse
        return {"loss": loss, "kl": kl, "budget": budget, "hidden_mse": mse, "mean_keep": mean_keep,
                "scores": scores.detach()}

    def warm_start_loss(self, capture: ContextCapture) -> torch.Tensor:
        """Listwise ranking loss of the logits against the value-weighted attention mass (stage 0).

        Target per (layer, batch, head): C_j = mass_j·‖v_j‖ over compressible tokens, normalised
        to a distribution; loss = cross-entropy of softmax(z) against it. No LLM backward.
        """
        hp = self.hparams
        compressible = compressible_mask(capture.context_length, hp.n_sink, hp.window, device=capture.keys.device)
        mass = torch.stack([capture.attention_mass[layer] for layer in range(len(capture.attention_mass))])
        value_weighted = (mass * capture.values.norm(dim=-1))[..., compressible]
        target = value_weighted / value_weighted.sum(dim=-1, keepdim=True).clamp_min(1e-12)
        logits = self.estimator(capture.keys, capture.values, capture.positions, capture.context_length)
        log_probs = torch.log_softmax(logits[..., compressible], dim=-1)
        return -(target * log_probs).sum(dim=-1).mean()

    def student_hidden(self, capture: ContextCapture, continuation: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """Continuation hidden states (batch, M, hidden) with ``bias`` (layers, batch, kv_heads, context)."""
        state = CompressionState("scored", capture.context_length, list(bias), self.hparams.backend)
        return continue_from(self.base, capture, continuation, state)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        if self.warm_start:
            capture, _, _ = self.teacher_pass(batch["input_ids"], batch["context_length"], capture_attention=True)
            loss = self.warm_start_loss(capture)
            self._last_mean_keep = None
            self.log("train/warm_start", loss, prog_bar=True, batch_size=batch["input_ids"].shape[0])
            return loss
        capture, continuation, teacher = self.teacher_pass(batch["input_ids"], batch["context_length"])
        out = self.distill(capture, continuation, teacher, keep_ratio=self.keep_ratio, hard=self.hard_topk)
        self._last_mean_keep = out["mean_keep"].detach()
        size = batch["input_ids"].shape[0]
        self.log_dict({"train/loss": out["loss"], "train/kl": out["kl"], "train/budget": out["budget"],
                       "train/mean_keep": out["mean_keep"].mean()}, prog_bar=True, batch_size=size)
        if self.hparams.hidden_mse_weight:
            self.log("train/hidden_mse", out["hidden_mse"], batch_size=size)
        effective = (out["scores"] > 0.5).float().mean(dim=(1, 2, 3))
        self.log_dict({f"keep_layer/{layer:02d}": value for layer, value in enumerate(effective)}, batch_size=size)
        return out["loss"]

    def on_train_batch_end(self, outputs, batch, batch_idx: int) -> None:
        if self._last_mean_keep is not None:
            self.budget.dual_step(self._last_mean_keep, self.keep_ratio)

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        """KL at the recipe's target ratio (not the curriculum's current one, so checks compare)."""
        ids, keep_ratio = batch["input_ids"], self.hparams.keep_ratio
        capture, continuation, teacher = self.teacher_pass(ids, batch["context_length"])
        for name, hard in (("kl_soft", False), ("kl_hard", True)):
            out = self.distill(capture, continuation, teacher, keep_ratio=keep_ratio, hard=hard)
            self.val_metrics[name].update(out["kl"])
        self.val_metrics["kl_recent"].update(self.recent_window_kl(capture, continuation, teacher, keep_ratio))
        self.log_dict({f"val/{name}": metric for name, metric in self.val_metrics.items()}, prog_bar=True,
                      batch_size=ids.shape[0])

    def recent_window_kl(self, capture: ContextCapture, continuation: torch.Tensor, teacher: torch.Tensor,
                         keep_ratio: float) -> torch.Tensor:
        """KL of keeping the most recent ⌈ρ·n⌉ compressible tokens (StreamingLLM), for reference."""
        recency = capture.positions.float().expand_as(capture.keys[..., 0])
        compressible = compressible_mask(capture.context_length, self.hparams.n_sink, self.hparams.window,
                                         device=continuation.device)
        bias, _ = keep_bias(recency, compressible, temperature=1.0, keep_ratio=keep_ratio, hard=True)
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
        """Keep only the estimator and budget state: the base model is frozen and reloadable.

        Exception: FSDP sharded checkpoints keep the base's shards, because Lightning resumes
        them through torch.distributed.checkpoint, which needs every key of the model.
        """
        if self._trainer is not None and saves_sharded_checkpoints(self.trainer.strategy):
            return
        checkpoint["state_dict"] = {key: value for key, value in checkpoint["state_dict"].items()
                                    if not key.startswith("base.")}
