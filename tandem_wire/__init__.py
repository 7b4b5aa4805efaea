"""The wire layer shared by the store, the engine and the clients: the generated protobuf
stubs (`tandem_wire.pb`, built from protos/, never committed), the hand-encoded bulk chunks of
Put and Get (`chunks`), and listening/connecting with or without TLS (`tls`).

It depends on grpcio and protobuf only, so the store runs without the client package and the
engine without the store's code."""
