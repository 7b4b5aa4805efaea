"""The model: loading through mlx-lm, the tokenizer view the front uses, mlx-lm adapters, the
embedded models.
"""
