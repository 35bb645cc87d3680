"""The public OpenAI-compatible REST gateway: HTTP in, NATS out.

    python -m tokenyard.services.gateway      # settings: TOKENYARD_GATEWAY_* (settings.py)

Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models[/{model}],
GET /health, /ready, /metrics, /openapi.json. A request is validated and tokenized here
(translate.py), placed by the router and queued for its prefill worker (backend.py), and
its TokenChunks come back on NATS to be ordered and shaped into OpenAI's JSON or SSE
(responses.py, serve.py). Errors always have OpenAI's shape (errors.py).
"""
