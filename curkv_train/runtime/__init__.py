"""curkv_train.runtime"""
