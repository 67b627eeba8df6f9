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


def first_line(e: BaseException, limit: int = 200) -> str:
    """The first line of ``e``'s message, at most ``limit`` characters, or its type name when empty.

    For one-line refusals that quote a library's exception (h5py, zipfile, an
    entry point's ImportError), whose messages may span lines.
    """
    text = str(e).splitlines()[0][:limit] if str(e) else ""
    return text or type(e).__name__


class NotComparableError(MismatchError):
    """The runs differ where neither reused anything from the prefix cache: they were not run alike."""
