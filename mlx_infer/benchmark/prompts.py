"""The benchmark's prompts, shipped with the package (prompts.jsonl beside this module): a few per prompt set
(chat, code, math, copy), and long prompts of an exact token count made by repeating them."""

import json
from pathlib import Path
from typing import Dict, List, Sequence

from ..errors import MlxInferError

#: One JSON object per line: {"set": "chat" | "code" | "math" | "copy", "prompt": text}.
PROMPTS_FILE = Path(__file__).resolve().parent / "prompts.jsonl"
#: The prompt sets, in the order the reports list them.
PROMPT_SETS = ("chat", "code", "math", "copy")
#: What a long prompt ends with, after the repeated text (so the model answers something).
LONG_TAIL = "\n\nSummarize the text above in one sentence."


def prompt_sets() -> Dict[str, List[str]]:
    """{set name: its prompts, in file order} for every set of PROMPT_SETS.

    Raises:
        MlxInferError: the shipped file is missing (a broken install: reinstall mlx-infer)."""
    if not PROMPTS_FILE.is_file():
        raise MlxInferError(f"the benchmark prompts are missing ({PROMPTS_FILE}): reinstall mlx-infer")
    sets: Dict[str, List[str]] = {name: [] for name in PROMPT_SETS}
    for line in PROMPTS_FILE.read_text(encoding="utf-8").splitlines():
        if line.strip():
            item = json.loads(line)
            sets.setdefault(item["set"], []).append(item["prompt"])
    return sets


def first_prompt(name: str = "chat") -> str:
    """The first prompt of set `name` (the decode suite's prompt)."""
    return prompt_sets()[name][0]


def long_ids(encode, tail_ids: Sequence[int], length: int) -> List[int]:
    """Token ids of exactly `length` tokens: the shipped prompts repeated, cut, then `tail_ids`.

    Args:
        encode: callable(text) -> token ids without a chat template (the model's tokenizer).
        tail_ids: ids the prompt ends with (the encoded LONG_TAIL; left out when they would take over half).
        length: tokens wanted, >= 1.
    """
    text = "\n\n".join(p for prompts in prompt_sets().values() for p in prompts)
    unit = list(encode(text))
    tail = list(tail_ids) if 2 * len(tail_ids) <= length else []
    body = length - len(tail)
    repeats = body // max(1, len(unit)) + 1
    return (unit * repeats)[:body] + tail
