"""One exception type for everything a user can get wrong (bad file, bad flag, config that cannot fit).
Entry points catch it, print `error: <message>` as one line and exit non-zero; it never shows a traceback."""
import contextlib
import os
import sys

INTERRUPTED_EXIT = 130       # exit status after Ctrl-C (128 + SIGINT), as shells report it


class LlmzError(Exception):
    """A problem with the user's input, described in one line that names the file or flag at fault."""
    exit_code = 1


class UsageError(LlmzError):
    """A command line refused at start, before any work (a flag, or a file a flag names): exit status 2,
    as argparse's own errors."""
    exit_code = 2


def print_out(text: str) -> None:
    """print(text) on stdout, flushed. A stdout that cannot take it (/dev/full, a full disk, a closed pipe) is
    an LlmzError, one line for the command to print on stderr; stdout then points at /dev/null, so that
    Python's own flush at exit adds no traceback of its own."""
    try:
        print(text, flush=True)
    except OSError as e:
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        raise LlmzError(f"cannot write to standard output ({e.strerror or e})") from None
class AgreedError(LlmzError):
    """An error raised on every rank alike (after llmz.run.launch.agree, or a check every rank makes the same
    way): rank 0 prints it once and every rank exits with its status; no rank waits for another, so no
    MPI_Abort is needed."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


@contextlib.contextmanager
def before_any_work():
    """Around the reading of the files the flags name, once the flags are checked and before any work: a
    plain LlmzError raised inside (token ids beyond V, a corrupt checkpoint, a NaN in a model) is a refusal at
    start, so it leaves as a UsageError (status 2); its subclasses (an AgreedError, a UsageError) as they are."""
    try:
        yield
    except LlmzError as e:
        if type(e) is not LlmzError:
            raise
        raise UsageError(str(e)) from None


def one_line_interrupts() -> None:
    """Ctrl-C before a command's main() handles it (while its imports run): one line and status 130, not
    a traceback. llmz/__init__.py calls this for `python -m llmz.<command>`, first thing (this module
    imports nothing more, so the window left is Python's own start-up)."""
    previous = sys.excepthook

    def hook(kind, value, tb):
        if issubclass(kind, KeyboardInterrupt):
            print("interrupted while starting", file=sys.stderr, flush=True)
            os._exit(INTERRUPTED_EXIT)
        previous(kind, value, tb)
    sys.excepthook = hook
