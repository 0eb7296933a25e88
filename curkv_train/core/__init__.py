"""What training, the runtime and the evaluation share: RoPE, selection arithmetic, shapes, atomic writes,
the observation window and the scoring features.

Nothing here imports Lightning, torchmetrics, the training objective, the data modules or the
training attention patch, so ``curkv_train.runtime`` stays light (a test checks it).
"""
