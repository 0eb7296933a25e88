"""User-facing errors: one line, what was wrong, what was expected, what to do."""


class CurKVError(Exception):
    """An error caused by the user's input; the CLI prints it on one line and exits 2."""


class EmptySplitError(CurKVError):
    """A data source has no text in the requested split."""
