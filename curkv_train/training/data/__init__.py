"""curkv_train.training.data"""
