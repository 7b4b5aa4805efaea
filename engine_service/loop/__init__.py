"""The batch loop on the MLX thread: scheduler, admission, jobs, commands, limits, new rows,
parking, preemption, turns, step checkpoints, warm-up.
"""
