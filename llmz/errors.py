"""One exception type for everything a user can get wrong (bad file, bad flag, config that cannot fit).
Entry points catch it, print `error: <message>` as one line and exit non-zero; it never shows a traceback."""


class LlmzError(Exception):
    """A problem with the user's input, described in one line that names the file or flag at fault."""
