"""The error of a configuration problem (rebm.config raises it; entry points print one line).
The class is defined in rebm/errors.py, below the registries that raise it too."""

from rebm.errors import ConfigError

__all__ = ["ConfigError"]
