"""The error of a configuration problem (rebm.config raises it; entry points print one line)."""

from rebm.errors import UserError


class ConfigError(UserError, ValueError):
    """A configuration problem the user can fix; its message is one line."""
