"""curkv_train.models"""
