"""KV cache primitives shared by the engine, the transports and the KV-cache service."""
