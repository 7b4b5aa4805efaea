"""Checkpoints: the manager, prefix reuse and its cache, generation checkpoints and metadata, the
spill queue, restore cost, cache records, attachments, device landing, host staging.
"""
