"""Package data: the top-level checkpoints/ folder, shipped inside curkv_train."""
