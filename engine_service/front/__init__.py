"""The engine's gRPC front process: servicer, wire conversion, response streams, text, metrics, and
its link to the core process.
"""
