"""curkv_train.eval"""
