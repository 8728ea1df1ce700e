"""The plugin's error type, in its own module so the GPU plugin and the CPU engine both import it
without importing each other."""


class UnsupportedVLLMVersionError(RuntimeError):
    """The installed vLLM is not one this plugin was checked against (or its code differs)."""
