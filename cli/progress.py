"""Rich progress on stderr: model loading (download messages, GGUF conversion), the one-time speculative
measurements, and the prefill of long prompts."""

import sys
from typing import Optional

from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

import mlx_infer
from mlx_infer.defaults import PREFILL_PROGRESS_TOKENS
from mlx_infer.errors import MlxInferError
from mlx_infer.paths import cache_dir, write_error

from .errors import as_flag

#: What the first line of a GGUF conversion adds when the conversion cache can be written.
CACHED_NOTE = "first run only; the result is cached"
#: All human-facing chatter goes to stderr; stdout carries only the answer (or JSON).
stderr = Console(stderr=True, highlight=False, soft_wrap=True)


class ProgressBar:
    """A `progress(done, total, desc)` callback drawing rich progress on stderr.

    On a terminal, `activity` (e.g. "loading model") shows as a spinner for as long as the bar
    is open; conversion steps (total > 0) add a bar under it; total == 0 means `desc` is a status
    message, printed as a line. When stderr is not a terminal no bar is drawn unless `always`
    (--verbose); status messages and the start of a conversion still get one plain line each.
    `note` follows that first line (a cached conversion's; "" for none). Use as a context manager.
    """

    def __init__(self, label: str = "converting", console: Console = stderr, always: bool = False,
                 activity: Optional[str] = None, note: str = CACHED_NOTE):
        self.label = label
        self.note = note
        self.console = console
        self.enabled = always or console.is_terminal
        self.activity = activity if console.is_terminal else None
        self._progress: Optional[Progress] = None
        self._task = None

    def _start(self) -> Progress:
        if self._progress is None:
            self._progress = Progress(
                SpinnerColumn(finished_text=" "),
                TextColumn("[bold]{task.fields[label]}[/bold]"),
                BarColumn(),
                TextColumn("{task.fields[detail]}"),
                TimeElapsedColumn(),
                console=self.console,
                transient=self.console.is_terminal,
            )
            self._progress.start()
        return self._progress

    def __call__(self, done: int, total: int, desc: str = "") -> None:
        if not self.enabled:
            # not a terminal: no bar, but the rare slow one-off steps (a download, a first-run conversion)
            # still get one line each, so a log never shows an unexplained pause
            if total <= 0:
                self.console.print(desc, markup=False)
            elif done == 1:
                self.console.print(f"{self.label}: {total} tensors" + (f" ({self.note})" if self.note else ""),
                                   markup=False)
            return
        if total <= 0:
            target = self._progress.console if self._progress else self.console
            target.print(f"[dim]{desc}[/dim]")
            return
        progress = self._start()
        detail = f"{done}/{total} [dim]{desc}[/dim]"
        if self._task is None:
            self._task = progress.add_task(desc, total=total, label=self.label, detail=detail)
        progress.update(self._task, completed=done, total=total, detail=detail)

    def open(self) -> "ProgressBar":
        """Show the activity spinner now (terminal only)."""
        if self.enabled and self.activity:
            self._start().add_task(self.activity, total=None, label=self.activity, detail="")
        return self

    def close(self) -> None:
        """Stop drawing (idempotent)."""
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def __enter__(self) -> "ProgressBar":
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()


def load_engine(model: Optional[str], weights: str, verbose: bool = False, rmm: Optional[str] = None):
    """`mlx_infer.load` with a progress bar (rmm: its RMM retention); says what was loaded on stderr when
    verbose."""
    note = CACHED_NOTE if write_error(cache_dir() / "gguf") is None else "the cache cannot be written: not cached"
    with ProgressBar("converting", always=verbose, activity=f"loading {model or 'the default model'}",
                     note=note) as bar:
        try:
            engine = mlx_infer.load(model, weights=weights, progress=bar, rmm=rmm)
        except MlxInferError as e:  # a layer range past this model's layers
            raise as_flag(e, "rmm") from e
    if verbose:
        src = engine.source
        stderr.print(f"[dim]model {src.name} ({src.kind}) from {src.path}; MLX dir {src.mlx_dir}; "
                     f"weights {src.weights}; context {engine.context_length} tokens[/dim]")
    return engine


def isatty(stream=None) -> bool:
    """Whether a stream (stdin by default) is an interactive terminal."""
    stream = stream or sys.stdin
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def prepare_speculation(engine, speculative: dict) -> None:
    """Run the one-time speculative measurements before the first request (a status line each on stderr),
    so that its TTFT and prefill tokens/s do not include them."""
    engine.prepare(speculative.get("speculative", "off"), speculative.get("draft_model"),
                   speculative.get("max_draft", "auto"), say=lambda msg: stderr.print(msg, style="dim", markup=False))


def defers_measurements(speculative: dict, kv_request: dict) -> bool:
    """Whether a request with these flags answers before the one-time speculative measurements: `--spec auto`
    (it decodes plainly until they are cached; Engine.defer_measurements). Other modes measure first, and
    with eviction auto decodes plainly (nothing to measure)."""
    return speculative.get("speculative") == "auto" and not kv_request


def measure_after_answer(engine, speculative: dict) -> None:
    """Take, once the answer is out, the measurements a deferred `--spec auto` request went without (cached:
    later requests speculate), saying first why on stderr, then a line per measurement; nothing when they
    are cached already."""
    said: list = []

    def say(msg: str) -> None:
        if not said:
            stderr.print("answered without speculative decoding (--spec auto) until this model's costs are "
                         "measured on this machine; measuring now, once", style="dim", markup=False)
        said.append(msg)
        stderr.print(msg, style="dim", markup=False)

    engine.prepare(speculative.get("speculative", "off"), speculative.get("draft_model"),
                   speculative.get("max_draft", "auto"), say=say)


class PrefillBar:
    """A `progress(done, total)` callback for Engine.stream_steps: a transient bar on stderr while a long
    prompt (PREFILL_PROGRESS_TOKENS or more tokens still to prefill) is processed; nothing for short ones
    or when stderr is not a terminal. Closes itself when prefill ends; `close()` is idempotent."""

    def __init__(self, console: Console = stderr):
        self.console = console
        self._progress: Optional[Progress] = None
        self._task = None
        self._first: Optional[int] = None

    def __call__(self, done: int, total: int) -> None:
        if self._first is None:
            self._first = done  # the kept prefix counts as done from the start
        if not self.console.is_terminal or total - self._first < PREFILL_PROGRESS_TOKENS:
            return
        if self._progress is None:
            self._progress = Progress(TextColumn("[bold]prefill[/bold]"), BarColumn(),
                                      TextColumn("{task.completed}/{task.total} tokens"), TimeElapsedColumn(),
                                      console=self.console, transient=True)
            self._progress.start()
            self._task = self._progress.add_task("prefill", total=total)
        self._progress.update(self._task, completed=done)
        if done >= total:
            self.close()

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

