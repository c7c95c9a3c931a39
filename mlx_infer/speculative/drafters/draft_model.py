"""Draft-model drafting: a smaller model with the target's tokenizer proposes gamma tokens autoregressively
(arXiv 2211.17192, 2302.01318), with its own KV cache kept consistent with the committed context.

Cache convention (same as the target's): before a proposal the draft cache holds a prefix of the context
that excludes at least the pending (last) token (empty until the first proposal); `propose` trims whatever it fed that the context no
longer agrees with (rejected draft tokens), then feeds the missing tail. After a full accept that tail is
two tokens (the last draft token, which the drafter sampled but never fed, and the bonus token): the
classic off-by-one is handled by construction, not by a special case.
"""

import json
import shutil
from pathlib import Path
from typing import Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

from ...defaults import PREFILL_STEP_SIZE
from ...errors import MlxInferError
from ...kv.attention_hook import install as install_attention
from ..verify import probabilities, process_logits
from .base import Draft, Drafter, Worth


def check_same_vocab(target_tokenizer, draft_tokenizer, what: str = "the draft model") -> None:
    """Raise MlxInferError unless the two tokenizers map the same strings to the same ids.

    Args:
        target_tokenizer, draft_tokenizer: mlx-lm TokenizerWrapper (or HF tokenizers) with get_vocab().
    """
    tv, dv = target_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
    if tv != dv:
        diff = len(set(tv.items()) ^ set(dv.items()))
        raise MlxInferError(
            f"{what} has a different tokenizer from the target ({len(dv)} vs {len(tv)} tokens, {diff} entries "
            "differ); speculative decoding needs the same vocabulary"
        )


class DraftModelDrafter(Drafter):
    """Proposes with a smaller mlx-lm model. Greedy params: argmax, deterministic (q None). Sampling params:
    samples from its own processed distribution (temperature, top-p, min-p, top-k as the target; no
    penalties) and returns those probabilities as q.

    Args:
        model: an mlx-lm model whose caches are trimmable; its attention blocks become the project's, in place
            (kv/attention_hook.install), as a target's do.
        ident: a stable identity (e.g. "draft:<path>") under which its calibration prior is cached; None: not
            cached (a model object handed in by the caller).

    Raises:
        MlxInferError: the draft model's cache cannot roll back.
    """

    name = "draft"

    def __init__(self, model: nn.Module, ident: Optional[str] = None):
        install_attention(model)
        self.model = model
        self.ident = ident
        if not can_trim_prompt_cache(make_prompt_cache(model)):
            raise MlxInferError("the draft model's KV cache cannot roll back (not trimmable); pick another draft model")
        self.cache = None
        self.fed: list = []
        self.params = None

    def begin(self, prompt_ids: Sequence[int], params) -> None:
        """Start a request. The prompt is fed at the first proposal, not here: a drafter the scheduler
        never runs costs no prefill."""
        self.params = params
        self.cache = make_prompt_cache(self.model)
        self.fed = []

    def _sync(self, context: Sequence[int]) -> list:
        """Trim the cache to the longest prefix of `context[:-1]` it holds; return the tokens still to feed."""
        limit = min(len(self.fed), len(context) - 1)
        a = np.asarray(self.fed[:limit], dtype=np.int64)
        b = np.asarray(context[:limit], dtype=np.int64)
        bad = np.nonzero(a != b)[0]
        keep = int(bad[0]) if bad.size else limit
        extra = len(self.fed) - keep
        if extra:
            trimmed = trim_prompt_cache(self.cache, extra)
            if trimmed != extra:
                raise RuntimeError(f"draft cache trimmed {trimmed} tokens, expected {extra}")
            del self.fed[keep:]
        return list(context[keep:])

    def propose(self, context: Sequence[int], gamma: int, worth: Worth = None) -> Draft:
        if gamma <= 0:
            return Draft([])
        tail = [int(t) for t in self._sync(context)]
        # catch up in prefill-sized chunks (the first proposal feeds the whole prompt); the last chunk
        # also gives the first draft token's logits
        last = (len(tail) - 1) // PREFILL_STEP_SIZE * PREFILL_STEP_SIZE
        for s in range(0, last, PREFILL_STEP_SIZE):
            self.model(mx.array(tail[s : s + PREFILL_STEP_SIZE], dtype=mx.uint32)[None], cache=self.cache)
            mx.eval([c.state for c in self.cache])
        y = mx.array(tail[last:], dtype=mx.uint32)  # [t], t >= 1
        greedy = self.params is None or self.params.greedy
        tokens, qs = [], []
        for _ in range(gamma):
            logits = self.model(y[None], cache=self.cache)[0, -1:, :]  # [1, V]
            if greedy:
                tok = mx.argmax(logits, axis=-1)  # [1]
            else:
                scaled = process_logits(logits, (), (), self.params)  # [1, V]
                tok = mx.random.categorical(scaled)
                qs.append(probabilities(scaled))
            y = tok.astype(mx.uint32)
            tokens.append(y)
            mx.async_eval(y)
        out = mx.concatenate(tokens)
        q = mx.concatenate(qs, axis=0) if qs else None
        mx.eval(out, *(() if q is None else (q,)))
        draft = out.tolist()
        # fed: the context tail and every draft token but the last
        self.fed.extend(tail + draft[:-1])
        return Draft(draft, q)


def cut_draft_model(source_dir, out_dir, num_layers: int) -> Path:
    """Write a draft model cut from a target: its first `num_layers` decoder layers, the final norm and the
    head (and embeddings), as a standalone MLX model directory `mlx_lm.load` opens (same tokenizer files).

    Args:
        source_dir: an MLX model directory (config.json + *.safetensors), e.g. `engine.source.mlx_dir`.
        out_dir: where to write (created; existing files overwritten).
        num_layers: layers to keep, 1 <= num_layers < the target's layer count.

    Returns:
        Path of out_dir.

    Raises:
        MlxInferError: bad num_layers or a directory without config.json / weights.
    """
    src, out = Path(source_dir), Path(out_dir)
    cfg_path = src / "config.json"
    if not cfg_path.is_file():
        raise MlxInferError(f"{src} is not an MLX model directory (no config.json)")
    config = json.loads(cfg_path.read_text())
    total = config.get("num_hidden_layers")
    if not isinstance(total, int) or not 1 <= num_layers < total:
        raise MlxInferError(f"num_layers must be in [1, {total}) for {src}, got {num_layers}")
    weights = {}
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise MlxInferError(f"{src} has no .safetensors weights")
    for f in files:
        weights.update(mx.load(str(f)))
    kept = {}
    for k, v in weights.items():
        parts = k.split(".")
        if "layers" in parts:
            i = parts.index("layers")
            if i + 1 < len(parts) and parts[i + 1].isdigit() and int(parts[i + 1]) >= num_layers:
                continue
        kept[k] = v
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and not f.name.endswith(".index.json") and f.name != "config.json":
            shutil.copy2(f, out / f.name)
    config["num_hidden_layers"] = num_layers
    (out / "config.json").write_text(json.dumps(config, indent=2))
    mx.save_safetensors(str(out / "model.safetensors"), kept, metadata={"format": "mlx"})
    return out
