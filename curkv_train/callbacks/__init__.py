"""curkv_train.callbacks"""
