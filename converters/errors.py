"""The one exception type for bad checkpoint input: its message is a single line naming the file or key."""


class CheckpointError(ValueError):
    """A checkpoint (or a request about one) that cannot be used as given."""
