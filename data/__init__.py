"""Package data: the top-level data/ folder, shipped inside curkv_train."""
