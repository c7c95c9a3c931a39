"""The suites of `mlx-infer bench --suite`: each times the loaded Engine against its peers on the same weights,
interleaved trial by trial (timing.interleaved), greedy, and gives back one JSON-ready dict:

    {"suite": name, "title": what it measures, "columns": [[key, header, format], ...],
     "rows": [{"case": ..., "system": ..., metrics..., "ratios": {peer: {metric: mlx-infer / peer}}}],
     "ratio_metrics": [metric, ...], "notes": [line, ...], plus suite-specific keys}

Ratios are mlx-infer's value over the peer's for rates (tokens/s: > 1 means mlx-infer is faster) and the
peer's over mlx-infer's for seconds (TTFT), so every ratio above 1 favours mlx-infer.
"""

import statistics
import time
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from ..errors import MlxInferError
from .defaults import COST_CURVE_WIDTH
from .options import BenchOptions, parse_suites  # noqa: F401  (parse_suites: re-exported for callers)
from .peers import MlxLmPeer, llama_cpp_runner
from .prompts import LONG_TAIL, first_prompt, long_ids, prompt_sets
from .timing import OnRun, interleaved, median, runs_per_case, time_tokens

#: The system every ratio is of.
OURS = "mlx-infer"
#: Metrics where less is better (their ratio is peer / mlx-infer).
LOWER_IS_BETTER = ("ttft_s", "wall_s")


def engine_tokens(engine, ids: Sequence[int], max_tokens: int, last: Optional[dict] = None, **kwargs) -> Iterator[int]:
    """Token ids of one greedy request from an empty KV cache (a whole prefill every run, as the peers');
    the request's GenerationStats go to last["stats"] when `last` is given."""
    engine.reset()
    for step in engine.stream_steps(list(ids), max_tokens=max_tokens, temperature=0.0, **kwargs):
        if step.stats is not None and last is not None:
            last["stats"] = step.stats
        if step.token is not None:
            yield step.token


def ratio(metric: str, ours: float, peer: float) -> Optional[float]:
    """ours / peer for a rate, peer / ours for LOWER_IS_BETTER; None when the divisor is 0 or not a number."""
    num, den = (peer, ours) if metric in LOWER_IS_BETTER else (ours, peer)
    return num / den if den and den == den and num == num else None


def rows_of(case: str, results: Dict[str, List[dict]], keys: Sequence[str], metrics: Sequence[str]) -> List[dict]:
    """One row per system of a case: the median of each key over its trials, and for every system whose name
    starts with OURS its ratios against each system that does not."""
    rows = []
    for system, trials in results.items():
        row = {"case": case, "system": system}
        for k in keys:
            values = [t[k] for t in trials if k in t]
            row[k] = statistics.median(values) if values else None
        rows.append(row)
    peers = [r for r in rows if not r["system"].startswith(OURS)]
    for row in rows:
        if row["system"].startswith(OURS):
            row["ratios"] = {p["system"]: {m: ratio(m, row[m], p[m]) for m in metrics
                                           if row.get(m) is not None and p.get(m) is not None} for p in peers}
    return rows


def fitting(lengths: Sequence[int], engine, max_tokens: int, what: str, notes: List[str]) -> List[int]:
    """The lengths whose prompt and `max_tokens` new tokens fit the model's context window; a note names the
    ones dropped."""
    limit = engine.context_length
    kept = [n for n in lengths if n + max_tokens <= limit]
    dropped = [n for n in lengths if n not in kept]
    if dropped:
        notes.append(f"{what} {', '.join(map(str, dropped))} left out: with {max_tokens} new tokens they pass the "
                     f"model's context window of {limit} tokens")
    return kept


class Runner:
    """The state the suites share: the engine, its mlx-lm peer (loaded once, on first use), the options and the
    progress callback."""

    def __init__(self, engine, options: BenchOptions, on_run: OnRun = None):
        self.engine = engine
        self.options = options
        self.on_run = on_run
        self._peer: Optional[MlxLmPeer] = None

    @property
    def peer(self) -> MlxLmPeer:
        """mlx-lm on the MLX directory the engine loaded (the same weights)."""
        if self._peer is None:
            self._peer = MlxLmPeer(self.engine.source.mlx_dir)
        return self._peer

    def raw_ids(self, text: str) -> List[int]:
        """Token ids of `text` without a chat template."""
        return self.engine.encode(text, chat_template=False)

    def long_prompt(self, length: int) -> List[int]:
        """Ids of exactly `length` tokens: the shipped prompts repeated, then LONG_TAIL."""
        return long_ids(self.raw_ids, self.raw_ids(LONG_TAIL), length)

    def cases(self, suite: str, cases: Sequence[Tuple[str, Dict[str, Callable[[], dict]]]]) -> Dict[str, Dict[str, List[dict]]]:
        """Run each case's runners interleaved ({case: {system: trials}}), reporting progress as
        (suite, runs done, runs in the suite)."""
        total = sum(runs_per_case(len(r), self.options.trials) for _, r in cases)
        done = [0]

        def tick() -> None:
            done[0] += 1
            if self.on_run is not None:
                self.on_run(suite, done[0], total)

        if self.on_run is not None:
            self.on_run(suite, 0, total)
        return {case: interleaved(runners, self.options.trials, tick) for case, runners in cases}

    def streams(self, ids: Sequence[int], max_tokens: int) -> Dict[str, Callable[[], dict]]:
        """Runners of mlx-infer and mlx-lm decoding `ids` greedily, each timed by time_tokens."""
        engine, peer = self.engine, self.peer
        return {OURS: lambda: time_tokens(engine_tokens(engine, ids, max_tokens)),
                peer.name: lambda: time_tokens(peer.stream(ids, max_tokens))}


def decode_suite(run: Runner) -> dict:
    """Decode tokens/s (and TTFT) of the first shipped chat prompt, chat-templated, against mlx-lm and
    llama.cpp (when found)."""
    engine, o = run.engine, run.options
    ids = engine.encode(first_prompt("chat"))
    runners = run.streams(ids, o.max_tokens)
    gguf = engine.source.path if engine.source.kind in ("gguf", "default") else None
    llama, llama_note = llama_cpp_runner(gguf, ids, o.max_tokens)
    if llama is not None:
        runners["llama.cpp"] = llama
    case = f"{len(ids)}-token prompt, {o.max_tokens} new"
    results = run.cases("decode", [(case, runners)])
    metrics = ["decode_tps", "ttft_s"]
    return {"suite": "decode", "title": "Decode tokens/s after a short chat prompt",
            "columns": [["decode_tps", "decode tok/s", ".1f"], ["ttft_s", "TTFT s", ".3f"], ["tokens", "tokens", ".0f"]],
            "ratio_metrics": metrics, "rows": rows_of(case, results[case], ["decode_tps", "ttft_s", "tokens"], metrics),
            "notes": [f"llama.cpp: {llama_note}"], "prompt_tokens": len(ids)}


def prefill_suite(run: Runner) -> dict:
    """Prefill tokens/s (prompt tokens / TTFT) at each prompt length that fits the context window."""
    notes: List[str] = []
    lengths = fitting(run.options.lengths, run.engine, 1, "prompt lengths", notes)
    cases = [(f"{n} tokens", run.streams(run.long_prompt(n), 1)) for n in lengths]
    results = run.cases("prefill", cases)
    rows = []
    for n, (case, _) in zip(lengths, cases):
        for trials in results[case].values():
            for t in trials:
                t["prefill_tps"] = n / t["ttft_s"]
        rows += [dict(r, context=n) for r in rows_of(case, results[case], ["prefill_tps", "ttft_s"], ["prefill_tps"])]
    return {"suite": "prefill", "title": "Prefill tokens/s by prompt length",
            "columns": [["prefill_tps", "prefill tok/s", ".1f"], ["ttft_s", "TTFT s", ".3f"]],
            "ratio_metrics": ["prefill_tps"], "rows": rows, "notes": notes}


def long_suite(run: Runner) -> dict:
    """TTFT and decode tokens/s after long prompts (the context the decoding attends to)."""
    o, notes = run.options, []
    contexts = fitting(o.contexts, run.engine, o.max_tokens, "contexts", notes)
    cases = [(f"{n}-token context", run.streams(run.long_prompt(n), o.max_tokens)) for n in contexts]
    results = run.cases("long", cases)
    metrics = ["decode_tps", "ttft_s"]
    rows = []
    for n, (case, _) in zip(contexts, cases):
        rows += [dict(r, context=n) for r in rows_of(case, results[case], ["decode_tps", "ttft_s", "tokens"], metrics)]
    return {"suite": "long", "title": "TTFT and decode tokens/s at long contexts",
            "columns": [["decode_tps", "decode tok/s", ".1f"], ["ttft_s", "TTFT s", ".3f"], ["tokens", "tokens", ".0f"]],
            "ratio_metrics": metrics, "rows": rows, "notes": notes}


def spec_runner(engine, prompts: List[List[int]], max_tokens: int, mode: str, outputs: dict) -> Callable[[], dict]:
    """A runner of every prompt of a set in speculative `mode`: tokens/s (all tokens / all seconds, prefill
    included), tau and per-position acceptance averaged over the prompts; the token ids of each prompt go
    to outputs[mode] (the last run's)."""

    def run() -> dict:
        tokens, seconds, taus, accept, used, ids = 0, 0.0, [], [], [], []
        for p in prompts:
            last: dict = {}
            start = time.perf_counter()
            out = list(engine_tokens(engine, p, max_tokens, last, speculative=mode))
            seconds += time.perf_counter() - start
            tokens += len(out)
            ids.append(out)
            stats = last["stats"]
            taus.append(stats.tau if stats.rounds else 1.0)
            accept.append(stats.acceptance or [])
            used.append(stats.spec_mode or "off")
        outputs[mode] = ids
        width = max((len(a) for a in accept), default=0)
        per_position = [statistics.mean(a[i] for a in accept if len(a) > i) for i in range(width)]
        return {"tps": tokens / seconds, "tau": statistics.mean(taus), "acceptance": per_position,
                "used": "/".join(sorted(set(used))), "tokens": tokens}

    return run


def peer_set_runner(peer: MlxLmPeer, prompts: List[List[int]], max_tokens: int) -> Callable[[], dict]:
    """mlx-lm's plain decoding of every prompt of a set: tokens/s over all of them."""

    def run() -> dict:
        tokens, start = 0, time.perf_counter()
        for p in prompts:
            tokens += sum(1 for _ in peer.stream(p, max_tokens))
        return {"tps": tokens / (time.perf_counter() - start), "tokens": tokens}

    return run


def spec_suite(run: Runner) -> dict:
    """Each speculative mode on each shipped prompt set: tokens/s, tau, acceptance per draft position, the
    speedup over plain decoding ("off") and whether the greedy output is the same; mlx-lm's plain decoding
    as the peer; then the target's verify cost curve (speculative/cost.py)."""
    engine, o = run.engine, run.options
    modes = ["off"] + [m for m in dict.fromkeys(o.modes) if m != "off"]
    outputs: Dict[str, Dict[str, list]] = {}
    cases = []
    for name, prompts in prompt_sets().items():
        ids = [engine.encode(p) for p in prompts[:o.prompts_per_set]]
        outputs[name] = {}
        runners = {f"{OURS} {m}": spec_runner(engine, ids, o.max_tokens, m, outputs[name]) for m in modes}
        runners[run.peer.name] = peer_set_runner(run.peer, ids, o.max_tokens)
        cases.append((name, runners))
    results = run.cases("spec", cases)
    rows = []
    for name, _ in cases:
        set_rows = rows_of(name, results[name], ["tps", "tau", "tokens"], ["tps"])
        off = next(r for r in set_rows if r["system"] == f"{OURS} off")["tps"]
        for r in set_rows:
            mode = r["system"][len(OURS) + 1:] if r["system"].startswith(OURS) else None
            if mode is not None:
                last = results[name][r["system"]][-1]
                r.update(mode=mode, used=last["used"], acceptance=last["acceptance"], speedup=r["tps"] / off,
                         identical=outputs[name][mode] == outputs[name]["off"])
            rows.append(dict(r, prompt_set=name))
    curve = engine.spec.curve(COST_CURVE_WIDTH)
    return {"suite": "spec", "title": "Speculative decoding by prompt set (greedy; tokens/s include prefill)",
            "columns": [["tps", "tok/s", ".1f"], ["used", "used", "s"], ["tau", "tau", ".2f"],
                        ["speedup", "vs off", ".2fx"], ["identical", "same output as off", "yes"],
                        ["acceptance", "acceptance by position", "list"]],
            "ratio_metrics": ["tps"], "rows": rows, "notes": [],
            "cost_curve": {"seconds": {str(w): s for w, s in sorted(curve.seconds.items())},
                           "plain_step": curve.plain_step}}


def batch_suite(run: Runner) -> dict:
    """N chat prompts decoded together: mlx-infer's continuous batching (Engine.generate_batch) against
    mlx-lm's BatchGenerator (mlx_lm.batch_generate); total tokens / wall seconds, prefill included."""
    engine, o, peer = run.engine, run.options, run.peer
    chats = prompt_sets()["chat"]
    eos = list(engine.tokenizer.eos_token_ids)
    cases = []
    for n in o.batch_sizes:
        ids = [engine.encode(chats[i % len(chats)]) for i in range(n)]

        def ours(ids=ids) -> dict:
            engine.reset()
            start = time.perf_counter()
            tokens = sum(len(r.token_ids) for r in engine.generate_batch(ids, max_tokens=o.max_tokens, temperature=0.0))
            return batch_result(tokens, time.perf_counter() - start)

        def theirs(ids=ids) -> dict:
            start = time.perf_counter()
            tokens = sum(len(t) for t in peer.batch(ids, o.max_tokens, eos))
            return batch_result(tokens, time.perf_counter() - start)

        cases.append((f"{n} requests", {OURS: ours, peer.name: theirs}))
    results = run.cases("batch", cases)
    rows = []
    for n, (case, _) in zip(o.batch_sizes, cases):
        rows += [dict(r, requests=n) for r in rows_of(case, results[case], ["total_tps", "wall_s", "tokens"], ["total_tps"])]
    return {"suite": "batch", "title": "Requests decoded together: total tokens/s (prefill included)",
            "columns": [["total_tps", "total tok/s", ".1f"], ["wall_s", "wall s", ".2f"], ["tokens", "tokens", ".0f"]],
            "ratio_metrics": ["total_tps"], "rows": rows, "notes": []}


def batch_result(tokens: int, seconds: float) -> dict:
    """A batch run's measurements: tokens, wall seconds, total tokens/s."""
    return {"tokens": tokens, "wall_s": seconds, "total_tps": tokens / seconds}


def kv_suite(run: Runner) -> dict:
    """Decode speed, TTFT and KV bytes per token over a float, 8-bit and 4-bit KV cache, against mlx-lm's own
    quantized KV cache (QuantizedKVCache, from the first token) on the same weights."""
    engine, o, peer = run.engine, run.options, run.peer
    notes: List[str] = []
    length = fitting([o.kv_context], engine, o.max_tokens, "the kv context", notes)
    ids = run.long_prompt(length[0] if length else max(1, engine.context_length - o.max_tokens - 1))
    cases, kept = [], []
    for bits in o.kv_bits:
        try:
            engine.configure_kv(kv_bits=bits)
        except MlxInferError as e:  # a head dim the quantized cache cannot hold
            notes.append(f"{bits}-bit KV left out: {e}")
            continue
        kept.append(bits)

        def ours(bits=bits) -> dict:
            engine.configure_kv(kv_bits=bits)
            last: dict = {}
            out = time_tokens(engine_tokens(engine, ids, o.max_tokens, last))
            out["kv_bytes_per_token"] = last["stats"].kv_bytes_per_token
            return out

        runners = {OURS: ours}
        if bits is None or peer.kv_group_size() is not None:
            runners[peer.name] = lambda bits=bits: peer.timed_kv(ids, o.max_tokens, bits)
        else:
            notes.append(f"mlx-lm left out at {bits} bits: no KV group size of {peer.name} divides this model's head dims")
        cases.append((f"{bits}-bit KV" if bits else "float KV", runners))
    try:
        results = run.cases("kv", cases)
    finally:
        engine.configure_kv(kv_bits=o.kv_bits_after)
    rows = []
    for bits, (case, _) in zip(kept, cases):
        rows += [dict(r, kv_bits=bits) for r in
                 rows_of(case, results[case], ["decode_tps", "ttft_s", "kv_bytes_per_token"], ["decode_tps"])]
    notes.append(f"{len(ids)}-token prompt; KV bytes of one token over all layers, K and V, scales included")
    return {"suite": "kv", "title": "Quantized KV cache: decode speed and bytes",
            "columns": [["decode_tps", "decode tok/s", ".1f"], ["ttft_s", "TTFT s", ".3f"],
                        ["kv_bytes_per_token", "KV bytes / token", ".0f"]],
            "ratio_metrics": ["decode_tps"], "rows": rows, "notes": notes}


#: Each suite's function, by name (SUITES' order).
SUITE_FUNCTIONS: Dict[str, Callable[[Runner], dict]] = {
    "decode": decode_suite, "prefill": prefill_suite, "long": long_suite, "spec": spec_suite,
    "batch": batch_suite, "kv": kv_suite,
}


def run_suites(engine, names: Sequence[str], options: Optional[BenchOptions] = None, on_run: OnRun = None) -> dict:
    """Run the named suites on a loaded Engine, in order.

    Args:
        engine: an mlx_infer Engine (its weights, KV and speculative settings as loaded / configured).
        names: suite names (SUITES); parse_suites turns a --suite value into them.
        options: BenchOptions (None: the defaults).
        on_run: progress callback(suite, runs done, runs in the suite), called before the first run too.

    Returns:
        {"model": name, "weights": ..., "kernels": the quantized layers' kernel or None, "trials", "max_tokens",
         "suites": {name: the suite's dict}}.

    Raises:
        MlxInferError: a trials or max_tokens count below 1.
    """
    o = options or BenchOptions()
    for flag, value in (("trials", o.trials), ("max_tokens", o.max_tokens)):
        if value < 1:
            raise MlxInferError(f"{flag} must be >= 1, got {value}")
    run = Runner(engine, o, on_run)
    suites = {name: SUITE_FUNCTIONS[name](run) for name in names}
    return {"model": engine.source.name, "weights": engine.source.weights, "kernels": engine.source.kernels,
            "trials": o.trials, "max_tokens": o.max_tokens, "suites": suites}
