"""KV caches as batch rows: the batch and ring caches, rows, planes, their state, and TurboQuant
(with its CUDA kernels).
"""
