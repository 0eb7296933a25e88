"""curkv_train.training.callbacks"""
