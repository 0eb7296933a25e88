"""curkv_train.data"""
