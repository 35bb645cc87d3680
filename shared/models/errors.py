"""The exceptions of loading a model, and of loading a LoRA adapter for it."""


class ModelLoadError(Exception):
    """A model path that cannot be loaded: missing, corrupt, truncated or unsupported."""


class InvalidAdapter(ValueError):
    """A LoRA adapter's files are missing, malformed, or do not fit the base model."""


class AdapterLimit(ValueError):
    """A LoRA adapter is well formed but beyond one of the engine's limits (`limit` names
    the setting: max_lora_rank, max_cpu_loras, max_loras; "name" for a name in use)."""

    def __init__(self, limit: str, message: str) -> None:
        super().__init__(message)
        self.limit = limit
