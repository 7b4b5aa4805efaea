"""Training the embedded default models (docs/training.md).

`python -m training` trains `tandem-tiny` (and its draft) from scratch on the Python
standard library's own source, on the CPU in well under an hour, seeded; the engine serves
the weights committed in engine_service/model/default_model/trained/.
"""
