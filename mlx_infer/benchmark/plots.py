"""The report's PNG plots (matplotlib, the optional `bench` extra: this module imports it at its top, so only
the report's caller imports this module, and only when matplotlib is there)."""

from pathlib import Path
from typing import List

import matplotlib

matplotlib.use("Agg")  # files only, no display

import matplotlib.pyplot as plt  # noqa: E402


def decode_by_context(results: dict, path: Path) -> bool:
    """Decode tokens/s against context (the long suite's contexts and the decode suite's prompt), one line per
    system; False when neither suite ran."""
    points: dict = {}
    suites = results["suites"]
    if "decode" in suites:
        for row in suites["decode"]["rows"]:
            points.setdefault(row["system"], []).append((suites["decode"]["prompt_tokens"], row["decode_tps"]))
    for row in suites.get("long", {}).get("rows", []):
        points.setdefault(row["system"], []).append((row["context"], row["decode_tps"]))
    if not points:
        return False
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for system, xy in points.items():
        xy = sorted(xy)
        ax.plot([x for x, _ in xy], [y for _, y in xy], marker="o", label=system)
    ax.set(xscale="log", xlabel="context (prompt tokens)", ylabel="decode tokens/s", title="Decode speed by context")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def verify_cost(results: dict, path: Path) -> bool:
    """The target's verify cost curve (ms per forward of w tokens, and against w = 1); False without the spec
    suite."""
    spec = results["suites"].get("spec")
    if spec is None:
        return False
    secs = {int(w): s for w, s in spec["cost_curve"]["seconds"].items()}
    widths = sorted(secs)
    fig, (ms, rel) = plt.subplots(1, 2, figsize=(10, 4))
    ms.plot(widths, [secs[w] * 1e3 for w in widths], marker="o")
    rel.plot(widths, [secs[w] / secs[widths[0]] for w in widths], marker="o")
    ms.set(xlabel="forward width (1 + draft tokens)", ylabel="ms per forward", title="Verify cost")
    rel.set(xlabel="forward width", ylabel=f"cost / cost of width {widths[0]}", title="Relative to one token")
    for ax in (ms, rel):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def spec_speedup(results: dict, path: Path) -> bool:
    """Speculative speedup over plain decoding per prompt set, one bar per mode; False without the spec suite."""
    spec = results["suites"].get("spec")
    if spec is None:
        return False
    rows = [r for r in spec["rows"] if r.get("mode") and r["mode"] != "off"]
    sets = list(dict.fromkeys(r["prompt_set"] for r in spec["rows"]))
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    fig, ax = plt.subplots(figsize=(6.5, 4))
    width = 0.8 / max(1, len(modes))
    for i, mode in enumerate(modes):
        values = {r["prompt_set"]: r["speedup"] for r in rows if r["mode"] == mode}
        ax.bar([j + i * width for j in range(len(sets))], [values.get(s, 0.0) for s in sets], width, label=mode)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xticks([j + width * (len(modes) - 1) / 2 for j in range(len(sets))], sets)
    ax.set(ylabel="tokens/s over plain decoding", title="Speculative speedup by prompt set")
    if modes:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


#: Each plot's file name and function.
PLOTS = (("decode_by_context.png", decode_by_context), ("verify_cost.png", verify_cost),
         ("spec_speedup.png", spec_speedup))


def write_plots(results: dict, folder: Path) -> List[Path]:
    """Draw every plot whose suites ran into `folder`; the files written."""
    return [folder / name for name, draw in PLOTS if draw(results, folder / name)]
