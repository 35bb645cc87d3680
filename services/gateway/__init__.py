"""The public OpenAI-compatible REST gateway: HTTP in, NATS out."""
