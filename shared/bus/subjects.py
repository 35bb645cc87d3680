"""Every NATS subject Tokenyard uses, in one place. Nothing else spells a subject."""

from __future__ import annotations

PREFIX = "ty"

# Request/reply: the gateway asks the router where a request should run.
ROUTER_ROUTE = f"{PREFIX}.router.route"

# JetStream work queue for prefill jobs (stream PREFILL_STREAM, queue group "prefill").
PREFILL_STREAM = "TY_PREFILL"
PREFILL_JOBS = f"{PREFIX}.prefill.jobs"
PREFILL_QUEUE_GROUP = "prefill"
PREFILL_SUBJECTS = [PREFILL_JOBS, f"{PREFILL_JOBS}.>"]  # the stream's subjects


def prefill_worker_jobs(worker_id: str) -> str:
    """Prefill jobs pinned to one worker by the router (still inside PREFILL_STREAM)."""
    return f"{PREFIX}.prefill.jobs.{worker_id}"


def decode_jobs(worker_id: str) -> str:
    return f"{PREFIX}.decode.{worker_id}.jobs"


def tokens(gateway_id: str, request_id: str, worker_id: str) -> str:
    """One request's token chunks from one worker, under the prefix of the gateway that waits
    for them: each gateway's NATS user may read only ``tokens(its id, "*", "*")``, and each
    worker's may publish only ``tokens("*", "*", its id)``, so the subject says who sent a
    chunk (`tokens_sender`), and the gateway takes it only from the request's workers."""
    return f"{PREFIX}.tokens.{gateway_id}.{request_id}.{worker_id}"


def request_tokens(gateway_id: str, request_id: str) -> str:
    """Every worker's chunks of one request (the gateway's subscription)."""
    return tokens(gateway_id, request_id, "*")


def tokens_sender(subject: str) -> str | None:
    """The worker that published on a tokens subject (None for any other subject)."""
    parts = subject.split(".")
    if len(parts) != 5 or parts[:2] != [PREFIX, "tokens"]:
        return None
    return parts[4]


def moved(gateway_id: str, request_id: str) -> str:
    """The router placed a departed worker's job of this request again (JobMoved); only the
    router may publish here."""
    return f"{PREFIX}.moved.{gateway_id}.{request_id}"


def cancel(gateway_id: str, request_id: str) -> str:
    """Cancel one request; a gateway may publish only under its own prefix."""
    return f"{PREFIX}.cancel.{gateway_id}.{request_id}"


CANCEL_ALL = f"{PREFIX}.cancel.*.*"


def replay(gateway_id: str, request_id: str) -> str:
    """Ask the workers of one request to publish its chunks again (the gateway lost some)."""
    return f"{PREFIX}.replay.{gateway_id}.{request_id}"


REPLAY_ALL = f"{PREFIX}.replay.*.*"


def kv_events(worker_id: str) -> str:
    return f"{PREFIX}.kv.events.{worker_id}"


KV_EVENTS_ALL = f"{PREFIX}.kv.events.*"


def kv_resync(worker_id: str) -> str:
    """Request/reply: a router that lost the thread of a worker's KV events asks it for a
    dump of the blocks it holds (KVResyncRequest -> KVDump)."""
    return f"{PREFIX}.kv.resync.{worker_id}"


def heartbeat(role: str, worker_id: str) -> str:
    return f"{PREFIX}.workers.{role}.{worker_id}.heartbeat"


HEARTBEATS_ALL = f"{PREFIX}.workers.*.*.heartbeat"


def heartbeat_sender(subject: str) -> tuple[str, str] | None:
    """(role, worker id) of a heartbeat subject; None for any other subject. NATS lets only
    that worker's user publish there, so this, not the payload, says who sent it."""
    parts = subject.split(".")
    if len(parts) != 5 or parts[:2] != [PREFIX, "workers"] or parts[4] != "heartbeat":
        return None
    return parts[2], parts[3]


def kv_events_sender(subject: str) -> str | None:
    """The worker id of a KV events subject (None for any other subject)."""
    parts = subject.split(".")
    if len(parts) != 4 or parts[:3] != [PREFIX, "kv", "events"]:
        return None
    return parts[3]


def facilities_readings(rack: str) -> str:
    return f"{PREFIX}.facilities.readings.{rack}"


FACILITIES_READINGS_ALL = f"{PREFIX}.facilities.readings.*"


def facilities_state(rack: str) -> str:
    return f"{PREFIX}.facilities.state.{rack}"


FACILITIES_STATE_ALL = f"{PREFIX}.facilities.state.*"


def telemetry_spans(service: str) -> str:
    """Finished spans (an OTLP ExportTraceServiceRequest) from one service process."""
    return f"{PREFIX}.telemetry.spans.{service}"


TELEMETRY_SPANS_ALL = f"{PREFIX}.telemetry.spans.*"


def drain(worker_id: str) -> str:
    """Request/reply: stop taking work, finish what runs, exit (the console's drain)."""
    return f"{PREFIX}.drain.{worker_id}"


def lora(worker_id: str) -> str:
    """Request/reply: load or unload a LoRA adapter on one worker (the gateway's admin API)."""
    return f"{PREFIX}.lora.{worker_id}"
