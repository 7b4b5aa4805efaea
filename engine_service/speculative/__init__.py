"""Speculative rows: the lane beside the main batch and the speculative batch itself."""
