"""The KV-cache service: KV blocks by content hash in RAM, Redis and disk, over gRPC."""
