"""The `mlx-infer` command: wires the subcommands into one typer app."""

import mlx_infer  # noqa: F401  (first: picks the optimized BLAS before mlx.core loads)

import inspect
import os
import sys
from typing import Callable

import typer

from .bench import bench
from .chat import chat
from .convert import convert
from .distributed import generate as generate_sharded
from .distributed import under_launch
from .distributed_front import chat as chat_sharded
from .distributed_front import serve as serve_sharded
from .doctor import doctor
from .errors import EXIT_BUG, click_exceptions, one_line_warnings, report_bug
from .generate import generate
from .models import models
from .serve import serve
from .train import train_drafter

app = typer.Typer(
    name="mlx-infer",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _help(command: Callable) -> str:
    """The command's docstring with each paragraph on one line: typer keeps the line breaks of the paragraphs
    after the first, and the terminal would break those lines again at its own width."""
    paragraphs = inspect.cleandoc(command.__doc__ or "").split("\n\n")
    return "\n\n".join(" ".join(line.strip() for line in p.splitlines()) for p in paragraphs)


# under mlx.launch, `generate` splits the model over the launch's ranks (cli/distributed.py)
app.command("generate", help=_help(generate_sharded) if under_launch() else _help(generate),
            epilog='Example: mlx-infer generate "What is the capital of France?" -n 64')(
    generate_sharded if under_launch() else generate)
# under mlx.launch, `chat` and `serve` run the model split over the ranks too (cli/distributed_front.py)
app.command("chat", help=_help(chat_sharded) if under_launch() else _help(chat),
            epilog="Example: mlx-infer chat --system 'Answer briefly.'")(chat_sharded if under_launch() else chat)
app.command("serve", help=_help(serve_sharded) if under_launch() else _help(serve),
            epilog="Example: mlx-infer serve --port 8080")(serve_sharded if under_launch() else serve)
app.command(help=_help(doctor))(doctor)
app.command(help=_help(models), epilog="Example: mlx-infer models --models-dir ~/models")(models)
app.command("ls", help=_help(models), hidden=True)(models)
app.command(help=_help(convert), epilog="Example: mlx-infer convert model.gguf ./model-mlx")(convert)
app.command(help=_help(bench), epilog="Example: mlx-infer bench --spec off --spec lookup -n 64")(bench)
app.command("train-drafter", help=_help(train_drafter),
            epilog="Example: mlx-infer train-drafter --kind dflash --data prompts.txt --out my-drafter")(train_drafter)


def version_callback(value: bool) -> None:
    """Print the version and exit."""
    if value:
        print(f"mlx-infer {mlx_infer.__version__}")
        raise typer.Exit()


@app.callback()
def root(
    version: bool = typer.Option(False, "--version", callback=version_callback, is_eager=True,
                                 help="Print the version and exit."),
) -> None:
    """MLX-native local LLM runtime: run GGUF and MLX models on Metal, CUDA or CPU.

    With no --model, commands use the embedded default, SmolLM2-135M-Instruct (Q4_1).
    """


def main() -> None:
    """Entry point of the `mlx-infer` command and `python -m mlx_infer`.

    A usage error (a flag of the wrong type, a missing argument, an unknown option) is one line on
    stderr and exit status 2, like every other bad input, instead of click's boxed usage text. An
    internal error that escapes a command is one line and exit status 1 (commands show its
    traceback with --verbose); warnings are one `warning: ...` line each.
    """
    one_line_warnings()
    try:
        code = app(prog_name="mlx-infer", standalone_mode=False)
    except click_exceptions.NoArgsIsHelpError as e:  # `mlx-infer` alone: the help text
        e.show()
        sys.exit(e.exit_code)
    except click_exceptions.UsageError as e:
        where = e.ctx.command_path if e.ctx is not None else "mlx-infer"
        # typer converts some values through pydantic, whose messages begin with its error kind
        message = e.format_message().replace(": Value error, ", ": ")
        if under_launch():  # the sharded commands take fewer flags than their one-process help lists
            if os.environ.get("MLX_RANK", "0") != "0":
                sys.exit(e.exit_code)  # rank 0 says it, once
            print(f"error: {message} under mlx.launch (see: mlx.launch -n 1 -- {where} --help)", file=sys.stderr)
            sys.exit(e.exit_code)
        print(f"error: {message} (see: {where} --help)", file=sys.stderr)
        sys.exit(e.exit_code)
    except click_exceptions.ClickException as e:
        print(f"error: {e.format_message()}", file=sys.stderr)
        sys.exit(e.exit_code)
    except typer.Abort:  # Ctrl-C or end of input at a prompt
        sys.exit(1)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except Exception as e:
        report_bug(e)
        sys.exit(EXIT_BUG)
    sys.exit(code if isinstance(code, int) else 0)
