"""Errors on the command line: bad input -> `error: ...` on stderr and exit code 2; a bug -> one
`error: ...` line naming the exception and exit code 1; --verbose adds the traceback. Warnings are
one `warning: ...` line each."""

import os
import re
import sys
import traceback
import warnings
from contextlib import contextmanager
from typing import Iterator

import typer

from mlx_infer.errors import MlxInferError

try:  # typer >= 0.29 vendors click; older releases use click itself
    from typer._click import exceptions as click_exceptions
except ImportError:
    from click import exceptions as click_exceptions

#: Exit code of an internal error (a bug in mlx-infer or a library under it).
EXIT_BUG = 1
#: Exit code of bad input (as click's usage errors).
EXIT_BAD_INPUT = 2
#: Exit code after Ctrl-C (128 + SIGINT), as shells report it.
EXIT_INTERRUPTED = 130

#: Errors a user causes: the library's own, and the OS refusing a path (permissions, disk full).
USER_ERRORS = (MlxInferError, OSError)
#: How the command line itself ends a command (exit codes, Ctrl-C at a prompt, usage errors): not errors here.
CLI_EXITS = (typer.Exit, typer.Abort, click_exceptions.ClickException)


#: The library's keyword names that its messages use, and the command line's flags for them.
PYTHON_FLAGS = {"kv_budget": "--kv-budget", "max_tokens": "--max-tokens", "kv_quant_start": "--kv-quant-start",
                 "kv_cache": "--kv-cache", "kv_bits": "--kv-bits", "kv_scheme": "--kv-scheme", "evict": "--evict"}
#: A keyword of PYTHON_FLAGS in a message, with its value when written name=value ("evict" only then: the
#: word alone is the verb).
_PYTHON_NAME = re.compile(r"(?<![\w-])(" + "|".join(n for n in PYTHON_FLAGS if n != "evict") + r"|evict(?==))"
                          r"(?:=(?:'([^']*)'|([\w.:]+)))?")


def flag_words(message: str) -> str:
    """A library message in the command line's words: 'raise kv_budget' -> 'raise --kv-budget',
    "kv_cache='dense'" -> '--kv-cache dense', 'evict=POLICY:RATIO' -> '--evict POLICY:RATIO'."""
    def flag(m: "re.Match") -> str:
        value = m.group(2) if m.group(2) is not None else m.group(3)
        return PYTHON_FLAGS[m.group(1)] + (f" {value}" if value is not None else "")
    return _PYTHON_NAME.sub(flag, message)


def as_flag(error: MlxInferError, name: str) -> MlxInferError:
    """The library's error about its keyword argument `name` ('rmm ...', 'rmm: ...') as the command line's
    about the flag ('--rmm ...'); other errors unchanged."""
    text = str(error)
    if text.startswith((name + " ", name + ":")):
        return MlxInferError("--" + name.replace("_", "-") + text[len(name):])
    return error


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
    text = one_line(error)
    print(f"error: {flag_words(text) if isinstance(error, MlxInferError) else text}", file=sys.stderr, flush=True)


def report_bug(error: BaseException, verbose: bool = False) -> None:
    """Print `error: internal error (TYPE): MESSAGE` on stderr, after the traceback when verbose,
    else with a pointer to --verbose."""
    if verbose:
        traceback.print_exception(type(error), error, error.__traceback__, file=sys.stderr)
    text = " ".join(str(error).split()) or "no message"
    hint = "" if verbose else "; --verbose shows the traceback"
    print(f"error: internal error ({type(error).__name__}): {text}{hint}", file=sys.stderr, flush=True)


def format_warning(message, category, filename, lineno, line=None) -> str:
    """`warnings.formatwarning` of the command line: `warning: MESSAGE`, one line."""
    return f"warning: {' '.join(str(message).split())}\n"


def one_line_warnings() -> None:
    """Show Python warnings as `warning: ...` lines on stderr, without the source line."""
    warnings.formatwarning = format_warning


@contextmanager
def user_errors(verbose: bool = False) -> Iterator[None]:
    """Run a command body: bad input exits with code 2 and one line, Ctrl-C with 130 quietly, a bug
    with code 1 and one line (its traceback with --verbose)."""
    try:
        yield
    except CLI_EXITS:
        raise
    except USER_ERRORS as e:
        if isinstance(e, BrokenPipeError):  # `mlx-infer generate ... | head -1`
            _silence_stdout()
            raise typer.Exit(0)
        report(e, verbose)
        raise typer.Exit(EXIT_BAD_INPUT)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        raise typer.Exit(EXIT_INTERRUPTED)
    except Exception as e:
        report_bug(e, verbose)
        raise typer.Exit(EXIT_BUG)


def fail(message: str) -> MlxInferError:
    """A user error raised by the CLI itself (checked before any model is loaded)."""
    return MlxInferError(message)


def _silence_stdout() -> None:
    """After a broken pipe, point stdout at /dev/null so the interpreter's final flush is quiet."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
