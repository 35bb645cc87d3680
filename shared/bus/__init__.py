"""The message bus: NATS subjects, connections, typed publish/request/subscribe."""
