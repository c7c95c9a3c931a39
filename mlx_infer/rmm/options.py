"""RMM retention options (`--rmm`), parsed and checked before any model work.

    --rmm attn=0.5,mlp=0.9,qk=0.75,pv=1.0     per component (retention ratio rho in (0, 1])
    --rmm mlp=0.5,down@0-3=1.0                per layer: `component@layers` (3, 0-3, 10-)
    --rmm light                               a preset (RMM_PRESETS), optionally followed by overrides

Components: the linear layers q, k, v, o (group `attn`) and gate, up, down (group `mlp`), and the attention
products qk (QK^T over head_dim) and pv (PV over tokens); `all` sets every one. Unnamed components keep
rho = 1 (exact). Later items override earlier ones.
"""

import math
import re
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

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

_ITEM = re.compile(r"^([a-z]+)(?:@([0-9]+)(?:(-)([0-9]*))?)?=(.+)$")

#: One override: (component, first layer, last layer or None for "to the end", rho).
Rule = Tuple[str, int, Optional[int], float]


@dataclass(frozen=True)
class Retention:
    """Retention ratios per component, and per layer where asked.

    Attributes:
        rules: (component, first layer, last layer (None: to the end), rho) in the order given; the
            last rule that covers a (component, layer) wins.
        text: the option as the user wrote it (for stats).
    """

    rules: Tuple[Rule, ...] = ()
    text: str = ""

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

    def __str__(self) -> str:
        return self.text


def _rho(value: str, item: str) -> float:
    try:
        rho = float(value)
    except ValueError:
        rho = math.nan
    if not 0.0 < rho <= 1.0:
        raise MlxInferError(f"--rmm {item!r}: the retention ratio must be a number in (0, 1], e.g. mlp=0.75")
    return rho


def parse_rmm(text: Optional[str]) -> Optional[Retention]:
    """The Retention of an `--rmm` value; None for None, "", "off", "none" or when every rho is 1.

    Raises:
        MlxInferError: an unknown preset or component, a bad layer range, a rho outside (0, 1], or
            per-layer rules on qk / pv.
    """
    if text is None or text.strip().lower() in ("", "off", "none"):
        return None
    rules = []
    for raw in text.split(","):
        item = raw.strip().lower()
        if not item:
            continue
        if "=" not in item:
            if item not in RMM_PRESETS:
                raise MlxInferError(f"--rmm: unknown preset {item!r}; use one of {', '.join(RMM_PRESETS)} or "
                                    "component=rho items (e.g. attn=0.5,mlp=0.9)")
            rules.extend(parse_rmm(RMM_PRESETS[item]).rules)
            continue
        m = _ITEM.match(item)
        if not m:
            raise MlxInferError(f"--rmm {item!r}: write component=rho or component@layers=rho (e.g. mlp@0-3=0.5)")
        name, first, dash, last, value = m.groups()
        if name not in COMPONENTS and name not in COMPONENT_GROUPS:
            raise MlxInferError(f"--rmm {item!r}: unknown component {name!r}; use one of "
                                f"{', '.join(tuple(COMPONENT_GROUPS) + COMPONENTS)}")
        lo = int(first) if first is not None else 0
        hi = None if first is None or (dash and not last) else int(last if dash else first)
        if hi is not None and hi < lo:
            raise MlxInferError(f"--rmm {item!r}: the layer range is empty ({lo} > {hi})")
        names = COMPONENT_GROUPS.get(name, (name,))
        if first is not None and set(names) & set(PRODUCT_COMPONENTS):
            raise MlxInferError(f"--rmm {item!r}: qk and pv take one ratio for every layer (drop the @layers)")
        rho = _rho(value, item)
        rules.extend((n, lo, hi, rho) for n in names)
    retention = Retention(tuple(rules), text.strip())
    return None if retention.exact else retention
