"""The engine core process: set-up, planning a request against the checkpoints, what the model's
caches can do.
"""
