"""The telemetry service: fleet, metrics, traces and facilities in one place, and the ops console."""
