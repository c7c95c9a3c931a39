"""Putting RMM into a loaded mlx-lm model: `reduce_model` swaps its linear layers in place,
`reduced_view` returns a copy of the module tree that shares every array (a self-drafter of the model).

A layer is a component by the name its path ends in (q_proj ... down_proj, options.LINEAR_COMPONENTS)
and belongs to decoder layer N when its path holds `layers.N`. Layers at rho = 1, and layers the kernels do
not take (other quantization modes), stay as they are. A per-layer rule that selects none of the model's
layers is an error (`Retention.check_layers`).
"""

import copy
import re
from typing import Optional, Tuple

import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map_with_path

from .layers import RmmLinear, RmmQuantizedLinear
from .options import LINEAR_COMPONENTS, Retention
from ..kernels.linear import supports

_LAYER = re.compile(r"(?:^|\.)layers\.([0-9]+)\.")


def component_of(path: str) -> Tuple[Optional[str], Optional[int]]:
    """(component, decoder layer) of a module path ("model.layers.3.mlp.down_proj" -> ("down", 3));
    (None, None) for modules that are no component."""
    component = LINEAR_COMPONENTS.get(path.rsplit(".", 1)[-1])
    m = _LAYER.search(path)
    return component, (int(m.group(1)) if m else None)


def layer_count(model: nn.Module) -> int:
    """Decoder layers of `model`: 1 + the largest N of a `layers.N` in its module paths (0 when none)."""
    last = -1
    for path, _ in tree_flatten(model.leaf_modules(), is_leaf=nn.Module.is_module):
        m = _LAYER.search(path)
        if m:
            last = max(last, int(m.group(1)))
    return last + 1


def _reduced(path: str, module: nn.Module, retention: Retention) -> nn.Module:
    component, layer = component_of(path)
    if component is None:
        return module
    rho = retention.rho(component, layer)
    if rho >= 1.0:
        return module
    if isinstance(module, nn.QuantizedLinear) and supports(module):
        return RmmQuantizedLinear(module, rho)
    if type(module) is nn.Linear:
        return RmmLinear(module, rho)
    return module


def reduce_model(model: nn.Module, retention: Retention) -> int:
    """Swap the linear layers of `model` that `retention` reduces for their RMM twins, in place (same
    arrays). Returns how many were swapped.

    Raises:
        MlxInferError: a per-layer rule of `retention` that selects none of the model's layers.
    """
    retention.check_layers(layer_count(model))
    swapped = 0

    def swap(path: str, module: nn.Module) -> nn.Module:
        nonlocal swapped
        new = _reduced(path, module, retention)
        swapped += new is not module
        return new

    leaves = tree_map_with_path(swap, model.leaf_modules(), is_leaf=nn.Module.is_module)
    model.update_modules(leaves)
    return swapped


def _copy_tree(value):
    """A copy of every module and list of a module tree; arrays and other leaves are shared."""
    if isinstance(value, nn.Module):
        new = copy.copy(value)
        for key, child in value.items():
            new[key] = _copy_tree(child)
        return new
    if isinstance(value, list):
        return [_copy_tree(v) for v in value]
    if isinstance(value, dict):
        return {k: _copy_tree(v) for k, v in value.items()}
    return value


def reduced_view(model: nn.Module, retention: Retention) -> nn.Module:
    """A copy of `model` (every module copied, every array shared: no weight memory) whose linear layers
    are reduced by `retention`; `model` itself is unchanged. Raises as reduce_model."""
    view = _copy_tree(model)
    reduce_model(view, retention)
    return view
