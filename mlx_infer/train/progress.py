"""Rich progress for `train-drafter` on stderr: a bar per phase (answers, features) and a training bar
with the loss (running mean of the last 20 steps) and predicted tokens per second.

On a terminal the bars are drawn live; otherwise nothing is drawn unless `always` (--verbose), and then a
plain line is printed about every 5% of a phase (logs stay readable).
"""

from collections import deque
from typing import Optional

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


class TrainProgress:
    """Callbacks for `train_drafter`: status(msg), phase(name, done, total), step(step, total, loss, tps).

    Args:
        console: where to draw (stderr by default).
        always: print progress even when the console is not a terminal (as plain lines).
    """

    def __init__(self, console: Optional[Console] = None, always: bool = False):
        self.console = console or Console(stderr=True, highlight=False, soft_wrap=True)
        self.live = self.console.is_terminal
        self.enabled = self.live or always
        self._progress: Optional[Progress] = None
        self._tasks = {}
        self._recent = deque(maxlen=20)

    def _bar(self) -> Progress:
        if self._progress is None:
            self._progress = Progress(
                TextColumn("[bold]{task.description}[/bold]"), BarColumn(), MofNCompleteColumn(),
                TextColumn("{task.fields[detail]}"), TimeElapsedColumn(), TimeRemainingColumn(),
                console=self.console, transient=False)
            self._progress.start()
        return self._progress

    def status(self, message: str) -> None:
        if self.enabled:
            (self._progress.console if self._progress else self.console).print(f"[dim]{message}[/dim]")

    def _update(self, name: str, done: int, total: int, detail: str = "") -> None:
        if not self.enabled:
            return
        if not self.live:
            every = max(1, total // 20)
            if done % every == 0 or done == total:
                self.console.print(f"{name} {done}/{total} {detail}".rstrip())
            return
        bar = self._bar()
        if name not in self._tasks:
            self._tasks[name] = bar.add_task(name, total=total, detail=detail)
        bar.update(self._tasks[name], completed=done, total=total, detail=detail)

    def phase(self, name: str, done: int, total: int) -> None:
        self._update(name, done, total)

    def step(self, step: int, total: int, loss: float, tokens_per_s: float) -> None:
        self._recent.append(loss)
        mean = sum(self._recent) / len(self._recent)
        self._update("training", step, total, f"loss {mean:.4f}  {tokens_per_s:,.0f} tok/s")

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def __enter__(self) -> "TrainProgress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
