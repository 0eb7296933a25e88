"""Package data: the top-level recipes/ folder, shipped inside curkv_train."""
