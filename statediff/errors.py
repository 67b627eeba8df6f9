"""The one exception type the CLI turns into a single stderr line and exit 2."""


class StatediffError(Exception):
    """Bad input or an unusable environment: reported as one line, exit code 2.

    Subclasses say which stage refused; the message must be a complete
    sentence that names the file or option involved.
    """


class TraceError(StatediffError):
    """A trace file is missing, unreadable, damaged, hostile or of another format."""


class MismatchError(StatediffError):
    """Two traces cannot be compared (different model, config or replay mode)."""
