"""`mlx-infer bench --report DIR`: report.md (the machine, then a markdown table per suite with mlx-infer's
ratios against each peer), results.json (the raw results), machine.json, and the PNG plots a plotter draws
(plots.py, when matplotlib is installed; else report.md says why they were skipped)."""

import json
from pathlib import Path
from typing import Callable, List, Optional

from ..errors import MlxInferError

#: A plotter: (results, folder) -> the PNG files it wrote.
Plotter = Callable[[dict, Path], List[Path]]

#: The machine's fields in report.md's header, with their labels.
MACHINE_FIELDS = (("cpu", "CPU / chip"), ("cores", "cores"), ("memory_bytes", "memory"), ("os", "OS"),
                  ("python", "Python"), ("mlx", "MLX"), ("mlx_lm", "mlx-lm"), ("mlx_infer", "mlx-infer"),
                  ("backend", "backend"), ("device", "device"), ("blas", "BLAS"), ("kernels", "kernels"))


def cell(value, fmt: str) -> str:
    """A table cell: fmt is a format spec (".1f"), ".2fx" (a ratio: "6.12x"), "yes" (a bool), "list" (numbers
    as "0.81 0.62"), or "s" (text); None is "-"."""
    if value is None:
        return "-"
    if fmt == "yes":
        return "yes" if value else "NO"
    if fmt == "list":
        return " ".join(f"{v:.2f}" for v in value) or "-"
    if fmt == "s":
        return str(value)
    if fmt.endswith("x"):
        return f"{value:{fmt[:-1]}}x"
    return f"{value:{fmt}}"


def peers_of(suite: dict) -> List[str]:
    """The systems mlx-infer's rows have ratios against, in row order."""
    seen: dict = {}
    for row in suite["rows"]:
        for peer in row.get("ratios", {}):
            seen[peer] = True
    return list(seen)


def suite_table(suite: dict) -> List[str]:
    """One suite as markdown lines: its title, a table (case, system, its columns, "vs PEER" per peer and
    ratio metric), its notes."""
    peers, metrics = peers_of(suite), suite["ratio_metrics"]
    ratio_cols = [(p, m) for p in peers for m in metrics]
    names = {k: h for k, h, _ in suite["columns"]}
    header = ["case", "system"] + [h for _, h, _ in suite["columns"]] + [
        f"vs {p}" + (f" ({names.get(m, m)})" if len(metrics) > 1 else "") for p, m in ratio_cols]
    lines = [f"## {suite['suite']}: {suite['title']}", "", "| " + " | ".join(header) + " |",
             "|" + "---|" * len(header)]
    for row in suite["rows"]:
        cells = [row["case"], row["system"]] + [cell(row.get(k), f) for k, _, f in suite["columns"]]
        cells += [cell(row.get("ratios", {}).get(p, {}).get(m), ".2fx") for p, m in ratio_cols]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [""] + [f"- {n}" for n in suite.get("notes", [])]
    return lines + ([""] if suite.get("notes") else [])


def machine_lines(machine: dict) -> List[str]:
    """The machine as a markdown list."""
    out = []
    for key, label in MACHINE_FIELDS:
        value = machine.get(key)
        if key == "memory_bytes" and value:
            value = f"{value / 2**30:.1f} GiB"
        if value not in (None, ""):
            out.append(f"- {label}: {value}")
    return out


def markdown(results: dict, machine: dict, command: str, plots: List[Path], plot_note: Optional[str]) -> str:
    """report.md's text."""
    lines = ["# mlx-infer bench", "", f"Command: `{command}`", "",
             f"Model: {results['model']} ({results['weights']} weights, quantized layers on "
             f"{results['kernels'] or 'MLX'}); greedy; {results['max_tokens']} new tokens per run; median of "
             f"{results['trials']} interleaved trials per system (after one warm-up run each). Ratios: mlx-infer "
             "over the peer for tokens/s, the peer over mlx-infer for seconds: above 1 favours mlx-infer.", "",
             "## Machine", ""] + machine_lines(machine) + [""]
    for suite in results["suites"].values():
        lines += suite_table(suite)
    lines += ["## Plots", ""]
    lines += [f"![{p.stem}]({p.name})" for p in plots] or [f"Plots skipped: {plot_note or 'nothing to plot'}."]
    return "\n".join(lines) + "\n"


def write_report(folder: Path, results: dict, machine: dict, command: str, plotter: Optional[Plotter] = None,
                 plot_note: Optional[str] = None) -> List[Path]:
    """Write report.md, results.json, machine.json and the plots into `folder` (made if missing).

    Args:
        results: suites.run_suites' dict.
        machine: machine.describe() (and whatever the caller adds: the kernels that ran).
        command: the command line that made it (named in report.md).
        plotter: plots.write_plots, or None when matplotlib is missing (then `plot_note` says why).

    Returns:
        The files written, report.md first.

    Raises:
        MlxInferError: the folder cannot be made or written (the OS's reason).
    """
    try:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "results.json").write_text(json.dumps({**results, "machine": machine, "command": command}, indent=1))
        (folder / "machine.json").write_text(json.dumps(machine, indent=1))
        plots = plotter(results, folder) if plotter is not None else []
        (folder / "report.md").write_text(markdown(results, machine, command, plots, plot_note))
    except OSError as e:
        raise MlxInferError(f"cannot write the report to {folder}: {e.strerror or e}; choose another --report folder") from e
    return [folder / "report.md", folder / "results.json", folder / "machine.json"] + plots
