"""Target hidden-state capture for block drafters (DFlash arXiv 2602.06036, DSpark): record the outputs of
chosen decoder layers during the forwards the target runs anyway (prefill and verify), no second forward.

Convention (Hugging Face): tap i is the OUTPUT of decoder layer i, i.e. `hidden_states[i + 1]`.

    with TargetTaps(model, [1, 9, 17]) as taps:
        logits = model(tokens, cache=cache)
        feats = taps.features()          # [1, L, 3 * H], the taps concatenated along features

Installing replaces each tapped layer in the model's own `.layers` list by a `_Tap` that calls the layer
and keeps its output; leaving the `with` puts the original layers back (parameter names are unchanged
outside it).
"""

from typing import Dict, List, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn

from ..errors import MlxInferError
from .target import decoder_layers


def default_layer_ids(num_target_layers: int, n: int) -> List[int]:
    """n evenly spaced tap ids over a target of `num_target_layers` layers, as the published drafters
    choose them when a config gives none: round(1 + i*(L-4)/(n-1)); n == 1 -> [L // 2]."""
    if n == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [int(round(1 + i * span / (n - 1))) for i in range(n)]


class _Tap(nn.Module):
    """A decoder layer that records its output (the first element when it returns a tuple) in `sink[idx]`.
    Unknown attributes are looked up on the wrapped layer, so models that inspect their layers still work."""

    def __init__(self, layer: nn.Module, sink: Dict[int, mx.array], idx: int):
        super().__init__()
        self.layer = layer
        self._sink = sink
        self._idx = idx

    def __getattr__(self, key):
        if key in self:
            return self[key]
        if key.startswith("_") or "layer" not in self:
            raise AttributeError(key)
        return getattr(self["layer"], key)

    def __call__(self, *args, **kwargs):
        out = self.layer(*args, **kwargs)
        self._sink[self._idx] = out[0] if isinstance(out, tuple) else out
        return out


class TargetTaps:
    """Captures the outputs of decoder layers `layer_ids` of an mlx-lm model (a context manager).

    Args:
        model: the target (any mlx-lm model with a `.layers` list).
        layer_ids: tapped decoder-layer indices, in the order their features are concatenated.

    Raises:
        MlxInferError: an index outside the model's layers.
    """

    def __init__(self, model: nn.Module, layer_ids: Sequence[int]):
        self.layers = decoder_layers(model)
        self.ids = [int(i) for i in layer_ids]
        bad = [i for i in self.ids if not 0 <= i < len(self.layers)]
        if bad or not self.ids:
            raise MlxInferError(
                f"the drafter taps target layers {self.ids}, but the target has {len(self.layers)} layers"
            )
        self.sink: Dict[int, mx.array] = {}
        self._saved: Optional[Dict[int, nn.Module]] = None

    def install(self) -> "TargetTaps":
        if self._saved is not None:
            return self
        self._saved = {}
        for i in sorted(set(self.ids)):
            layer = self.layers[i]
            if isinstance(layer, _Tap):
                raise RuntimeError(f"decoder layer {i} is already tapped by another capture")
            self._saved[i] = layer
            self.layers[i] = _Tap(layer, self.sink, i)
        return self

    def remove(self) -> None:
        if self._saved is None:
            return
        for i, layer in self._saved.items():
            self.layers[i] = layer
        self._saved = None
        self.sink.clear()

    __enter__ = install

    def __exit__(self, *exc) -> None:
        self.remove()

    def features(self) -> mx.array:
        """The last forward's taps concatenated along features: [1, L, n*H] (the target's dtype); clears them.

        Raises:
            RuntimeError: a tapped layer did not run since the last call.
        """
        missing = [i for i in self.ids if i not in self.sink]
        if missing:
            raise RuntimeError(f"target layers {missing} were not captured (no forward since the last read?)")
        out = mx.concatenate([self.sink[i] for i in self.ids], axis=-1)
        self.sink.clear()
        return out
