"""RMM retention options (`--rmm`), parsed and checked before any model work.

    --rmm attn=0.5,mlp=0.9,qk=0.75,pv=1.0     per component (retention ratio rho in (0, 1])
    --rmm mlp=0.5,down@0-3=1.0                per layer: `component@layers` (3, 0-3, 10-)
    --rmm light                               a preset (RMM_PRESETS), optionally followed by overrides

Components: the linear layers q, k, v, o (group `attn`) and gate, up, down (group `mlp`), and the attention
products qk (QK^T over head_dim) and pv (PV over tokens); `all` sets every one. Unnamed components keep
rho = 1 (exact). Later items override earlier ones. Numbers (rho and layers) are ASCII digits; every item
between commas must be there (no trailing or doubled comma). `str(retention)` is the canonical form: the
same text for every way of writing the same retention.
"""

import math
import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple, Union

from ..errors import MlxInferError
from .defaults import RMM_PRESETS

#: The linear components, by the mlx-lm module name that ends their path.
LINEAR_COMPONENTS = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o",
                     "gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
#: The attention products.
PRODUCT_COMPONENTS = ("qk", "pv")
COMPONENTS = tuple(LINEAR_COMPONENTS.values()) + PRODUCT_COMPONENTS
#: Names that stand for several components.
COMPONENT_GROUPS = {"attn": ("q", "k", "v", "o"), "mlp": ("gate", "up", "down"), "all": COMPONENTS,
                    "linear": tuple(LINEAR_COMPONENTS.values())}

_ITEM = re.compile(r"^([a-z]+)(?:@([^=]*))?=(.*)$")
#: Layers of a per-layer item: N, N-M or N- (ASCII digits).
_LAYERS = re.compile(r"^([0-9]+)(?:(-)([0-9]*))?$")
#: A retention ratio: a decimal number in ASCII digits, optionally with an exponent (0.75, .5, 1, 5e-1).
_RHO = re.compile(r"^(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:e[+-]?[0-9]+)?$")

#: One override: (component, first layer, last layer or None for "to the end", rho).
Rule = Tuple[str, int, Optional[int], float]


#: A per-layer item as written, with its layer range: (item, first layer, last layer or None).
LayerItem = Tuple[str, int, Optional[int]]


@dataclass(frozen=True)
class Retention:
    """Retention ratios per component, and per layer where asked.

    Attributes:
        rules: (component, first layer, last layer (None: to the end), rho) in the order given; the
            last rule that covers a (component, layer) wins.
        text: the option as the user wrote it.
        layer_items: the per-layer items as written, with their ranges (checked against the model by
            `check_layers`).
    """

    rules: Tuple[Rule, ...] = ()
    text: str = ""
    layer_items: Tuple[LayerItem, ...] = ()

    def rho(self, component: str, layer: Optional[int] = None) -> float:
        """rho of `component` in decoder layer `layer` (None: a module outside the layer stack, which only
        layer-free rules cover); 1.0 where no rule applies."""
        out = 1.0
        for name, first, last, value in self.rules:
            if name != component:
                continue
            if first == 0 and last is None:
                out = value
            elif layer is not None and first <= layer and (last is None or layer <= last):
                out = value
        return out

    @property
    def exact(self) -> bool:
        """Whether every rho is 1 (the model is unchanged)."""
        return all(value >= 1.0 for *_, value in self.rules)

    def products(self) -> Dict[str, float]:
        """rho of qk and pv for every layer (the attention products take no per-layer rules)."""
        return {c: self.rho(c) for c in PRODUCT_COMPONENTS}

    def check_layers(self, count: int) -> None:
        """Raise MlxInferError (one line, naming `count`) when a per-layer item selects none of a model's
        `count` decoder layers (0 .. count - 1)."""
        for item, first, _ in self.layer_items:
            if first >= count:
                have = f"{count} layers (0-{count - 1})" if count else "no decoder layers RMM reduces"
                raise MlxInferError(f"rmm {item!r}: this model has {have}, so the range selects none; "
                                    "give layers within the model")

    def canonical(self) -> str:
        """The retention as normalized text: components in a fixed order (groups where all their members
        agree), a layer-free rho first, then the disjoint layer ranges that differ from it, ascending;
        exact components left out. Two spellings of the same retention give the same text, and
        parse_rmm of it gives back the same rho for every component and layer."""
        items = {c: _component_items(self, c) for c in COMPONENTS}
        out: List[str] = []
        for group in _CANONICAL_GROUPS:
            names = COMPONENT_GROUPS.get(group, (group,))
            if any(c not in items for c in names) or len({tuple(items[c]) for c in names}) != 1:
                continue
            out.extend(_format_item(group, item) for item in items[names[0]])
            for c in names:
                del items[c]
        return ",".join(out)

    def __str__(self) -> str:
        return self.canonical()


#: The order canonical() tries names in: a group before its members, so "attn=0.5,mlp=0.5" -> "linear=0.5".
_CANONICAL_GROUPS = ("all", "linear", "attn", "mlp") + COMPONENTS

#: One item of the canonical form: (first layer, last layer, rho); first None: the layer-free rho.
_CanonicalItem = Tuple[Optional[int], Optional[int], float]


def _component_items(retention: Retention, component: str) -> List[_CanonicalItem]:
    """The canonical items of one component: its layer-free rho (when not 1), then the maximal layer ranges
    whose rho differs from it."""
    base = retention.rho(component)
    starts = {0}
    for name, first, last, _ in retention.rules:
        if name == component:
            starts.add(first)
            if last is not None:
                starts.add(last + 1)
    bounds = sorted(starts)
    ranges: List[Tuple[int, Optional[int], float]] = []  # (first, last, rho), merged where neighbours agree
    for i, first in enumerate(bounds):
        last = bounds[i + 1] - 1 if i + 1 < len(bounds) else None
        value = retention.rho(component, first)
        if ranges and ranges[-1][2] == value:
            ranges[-1] = (ranges[-1][0], last, value)
        else:
            ranges.append((first, last, value))
    items: List[_CanonicalItem] = [] if base >= 1.0 else [(None, None, base)]
    for first, last, value in ranges:
        if value == base:
            continue
        if first == 0 and last is None:  # "c@0-" would also set the layer-free rho: split it
            items += [(0, 0, value), (1, None, value)]
        else:
            items.append((first, last, value))
    return items


def _format_item(name: str, item: _CanonicalItem) -> str:
    first, last, value = item
    text = f"{value:g}" if float(f"{value:g}") == value else repr(value)
    if first is None:
        return f"{name}={text}"
    layers = f"{first}" if last == first else f"{first}-" if last is None else f"{first}-{last}"
    return f"{name}@{layers}={text}"


def _rho(value: str, item: str) -> float:
    value = value.strip()
    rho = float(value) if _RHO.match(value) else math.nan
    if not 0.0 < rho <= 1.0:
        raise MlxInferError(f"rmm {item!r}: the retention ratio must be a number in (0, 1] in ASCII digits, "
                            "e.g. mlp=0.75")
    return rho


def _layers(text: str, item: str) -> Tuple[int, Optional[int]]:
    """(first, last or None for "to the end") of an item's `@layers`."""
    m = _LAYERS.match(text.strip())
    if not m:
        raise MlxInferError(f"rmm {item!r}: layers are N, N-M or N- in ASCII digits (e.g. mlp@0-3=0.5)")
    first, dash, last = m.groups()
    lo = int(first)
    hi = None if dash and not last else int(last if dash else first)
    if hi is not None and hi < lo:
        raise MlxInferError(f"rmm {item!r}: the layer range is empty ({lo} > {hi}); write the lower layer first "
                            f"({hi}-{lo})")
    return lo, hi


def _type_error(value) -> MlxInferError:
    return MlxInferError(f"rmm must be a string like \"attn=0.5,mlp=0.9\" or a preset name "
                         f"({', '.join(RMM_PRESETS)}), got {type(value).__name__} {value!r}")


def parse_rmm(text: Union[None, str, Retention]) -> Optional[Retention]:
    """The Retention of an `--rmm` value; None for None, "", "off", "none" or when every rho is 1. A
    Retention is taken as it is (None when exact).

    Raises:
        MlxInferError: a value that is no string; an unknown preset or component, an empty item (a
            trailing or doubled comma), a bad or reversed layer range, a rho outside (0, 1], numbers not in
            ASCII digits, or per-layer rules on qk / pv.
    """
    if isinstance(text, Retention):
        return None if text.exact else text
    if text is not None and not isinstance(text, str):
        raise _type_error(text)
    if text is None or text.strip().lower() in ("", "off", "none"):
        return None
    rules: List[Rule] = []
    layer_items: List[LayerItem] = []
    for raw in text.split(","):
        item = raw.strip().lower()
        if not item:
            raise MlxInferError(f"rmm {text.strip()!r}: an empty item (a trailing or doubled comma); "
                                "separate items by one comma, e.g. attn=0.5,mlp=0.9")
        if "=" not in item:
            if item not in RMM_PRESETS:
                raise MlxInferError(f"rmm: unknown preset {item!r}; use one of {', '.join(RMM_PRESETS)} or "
                                    "component=rho items (e.g. attn=0.5,mlp=0.9)")
            preset = parse_rmm(RMM_PRESETS[item])
            rules.extend(preset.rules if preset is not None else ())
            continue
        m = _ITEM.match(item)
        if not m:
            raise MlxInferError(f"rmm {item!r}: write component=rho or component@layers=rho (e.g. mlp@0-3=0.5)")
        name, layers, value = m.groups()
        if name not in COMPONENTS and name not in COMPONENT_GROUPS:
            raise MlxInferError(f"rmm {item!r}: unknown component {name!r}; use one of "
                                f"{', '.join(tuple(COMPONENT_GROUPS) + COMPONENTS)}")
        lo, hi = _layers(layers, item) if layers is not None else (0, None)
        names = COMPONENT_GROUPS.get(name, (name,))
        if layers is not None and set(names) & set(PRODUCT_COMPONENTS):
            raise MlxInferError(f"rmm {item!r}: qk and pv take one ratio for every layer (drop the @layers)")
        rho = _rho(value, item)
        rules.extend((n, lo, hi, rho) for n in names)
        if layers is not None:
            layer_items.append((item, lo, hi))
    retention = Retention(tuple(rules), text.strip(), tuple(layer_items))
    return None if retention.exact else retention
