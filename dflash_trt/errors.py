"""User-facing errors.

Every error a user can cause with bad input (wrong paths, mismatched drafter/target, corrupt
files, impossible settings) is raised as :class:`DFlashError`. The CLI prints its message as a
single line and exits with status 2; anything else is a bug and keeps its traceback.
"""


class DFlashError(Exception):
    """An error caused by user input, reported as one line without a traceback."""
