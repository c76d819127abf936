"""One base class for errors the user can fix (bad config, missing file, wrong launch).

Entry points print such an error as one line and exit with code 2, without a traceback;
anything else is a bug and keeps its traceback.
"""


class UserError(Exception):
    """An error whose message names the key/file/path and what to do."""


class ConfigError(UserError, ValueError):
    """A configuration problem the user can fix; its message is one line. Defined here, at the
    bottom, for the registries (rebm/registry.py); rebm.config raises it (rebm.config.errors)."""
