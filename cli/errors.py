"""Bad input -> `error: ...` on stderr and exit code 2; --verbose adds the traceback."""

import sys
import traceback
from contextlib import contextmanager
from typing import Iterator

import typer

from mlx_infer.errors import MlxInferError

#: Exit code of bad input (as click's usage errors).
EXIT_BAD_INPUT = 2
#: Exit code after Ctrl-C (128 + SIGINT), as shells report it.
EXIT_INTERRUPTED = 130

#: Errors a user causes: the library's own, and the OS refusing a path (permissions, disk full).
USER_ERRORS = (MlxInferError, OSError)


def one_line(error: BaseException) -> str:
    """The error's message on a single line."""
    text = " ".join(str(error).split())
    if isinstance(error, MlxInferError) or not text:
        return text or type(error).__name__
    return f"{text} ({type(error).__name__})"


def report(error: BaseException, verbose: bool = False) -> None:
    """Print `error: MESSAGE` on stderr, after the traceback when verbose."""
    if verbose:
        traceback.print_exception(type(error), error, error.__traceback__, file=sys.stderr)
    print(f"error: {one_line(error)}", file=sys.stderr, flush=True)


@contextmanager
def user_errors(verbose: bool = False) -> Iterator[None]:
    """Run a command body: bad input exits with code 2 and one line, Ctrl-C with 130 quietly.

    Anything else is a bug and keeps its traceback.
    """
    try:
        yield
    except USER_ERRORS as e:
        if isinstance(e, BrokenPipeError):  # `mlx-infer generate ... | head -1`
            _silence_stdout()
            raise typer.Exit(0)
        report(e, verbose)
        raise typer.Exit(EXIT_BAD_INPUT)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        raise typer.Exit(EXIT_INTERRUPTED)


def fail(message: str) -> MlxInferError:
    """A user error raised by the CLI itself (checked before any model is loaded)."""
    return MlxInferError(message)


def _silence_stdout() -> None:
    """After a broken pipe, point stdout at /dev/null so the interpreter's final flush is quiet."""
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
