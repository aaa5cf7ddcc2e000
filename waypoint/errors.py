"""The one exception type for bad checkpoint input: its message is a single line naming the file or key."""


class CheckpointError(ValueError):
    """A checkpoint (or a request about one) that cannot be used as given."""


def first_line(text: object) -> str:
    """The first non-blank line of an error's message (or of any text), stripped; an error without one is named
    by its type."""
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    return lines[0] if lines else type(text).__name__ if isinstance(text, BaseException) else ""
