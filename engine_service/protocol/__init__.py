"""What crosses between the gRPC front and the MLX core process: channel messages, requests,
events, stats, flush results, KV codec choices. Imports no mlx.
"""
