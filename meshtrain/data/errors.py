"""The one exception bad data raises. The CLI prints it without a traceback and exits 2."""


class DataError(ValueError):
    """A data file or data setting that cannot work: one line naming the file (and line,
    for preprocess input), what is wrong, and the fix."""

    def __init__(self, message: str):
        # One line whatever went into it (a key or a path can hold a newline): the CLI
        # prints it after "data error:" and logs grep it.
        super().__init__(" ".join(str(message).splitlines()))
