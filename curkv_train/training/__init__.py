"""Training: the LightningModule (system), the objective, the scored-attention patch, data, callbacks."""
