"""Training the embedded default models (docs/training.md).

`python -m training` trains `tandem-tiny` (and its draft) from scratch on the Python
standard library's own source, seeded, on a CPU in two data-parallel ranks
(training/ranks.py; how long it takes: docs/training.md); the engine serves the weights
committed in engine_service/model/default_model/trained/.
"""
