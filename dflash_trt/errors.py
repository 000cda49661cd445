"""User-facing errors.

Every error a user can cause with bad input (wrong paths, mismatched drafter/target, corrupt
files, impossible settings) is raised as :class:`DFlashError`. The CLI prints its message as a
single line and exits with status 2; anything else is a bug and keeps its traceback.
"""


class DFlashError(Exception):
    """An error caused by user input, reported as one line without a traceback."""


class ConfigError(DFlashError):
    """An impossible setting. ``name`` is the setting's field name (an ``EngineArgs`` or
    ``TrainConfig`` field), shown as a flag (``--block-size``) by the CLI and as is
    (``block_size``) elsewhere."""

    def __init__(self, name: str, message: str):
        self.name, self.message = name, message
        super().__init__(f"{name} {message}")

    def with_name(self, shown: str) -> DFlashError:
        """The same error with the setting shown as ``shown`` (a CLI flag)."""
        return DFlashError(f"{shown} {self.message}")
