"""curkv-train: train value estimators for KV-cache compression."""
