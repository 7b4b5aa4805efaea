"""Sampling and structured output: samplers, constraints, their compile budget, the batch's
masks."""
