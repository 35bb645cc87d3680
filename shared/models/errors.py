"""The one exception every model-loading failure raises."""


class ModelLoadError(Exception):
    """A model path that cannot be loaded: missing, corrupt, truncated or unsupported."""
