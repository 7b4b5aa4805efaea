"""tandem-gateway: one front (OpenAI-compatible HTTP and the Tandem gRPC API) for many
engines, routing by load and prefix, resuming a stream on another engine when one dies."""
