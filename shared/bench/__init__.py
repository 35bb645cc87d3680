"""`tokenyard bench`: a load generator and meter for any OpenAI-compatible server.

workloads -> runner (closed or open loop) -> client (one streamed request, timed at the
byte level) -> records -> metrics (summary, goodput) -> report / plots / JSON.
"""
