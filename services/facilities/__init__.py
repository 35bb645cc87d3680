"""The facilities service: rack telemetry in, per-rack placement state out (NATS), history in SQL."""
