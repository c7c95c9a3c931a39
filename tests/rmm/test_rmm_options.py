"""`--rmm` parsing: components, groups, per-layer rules, presets, and one-line errors."""

import pytest

from mlx_infer.errors import MlxInferError
from mlx_infer.rmm.defaults import RMM_PRESETS
from mlx_infer.rmm.options import parse_rmm


def test_components_and_groups():
    r = parse_rmm("attn=0.5,mlp=0.9,qk=0.75,pv=1.0")
    assert [r.rho(c, 3) for c in ("q", "k", "v", "o")] == [0.5] * 4
    assert [r.rho(c, 3) for c in ("gate", "up", "down")] == [0.9] * 3
    assert r.products() == {"qk": 0.75, "pv": 1.0}
    assert str(r) == "attn=0.5,mlp=0.9,qk=0.75,pv=1.0"


def test_later_items_override_and_layers():
    r = parse_rmm("mlp=0.5,down@0-3=1.0,up@10-=0.25,gate@7=0.75")
    assert r.rho("down", 0) == r.rho("down", 3) == 1.0 and r.rho("down", 4) == 0.5
    assert r.rho("up", 9) == 0.5 and r.rho("up", 10) == r.rho("up", 29) == 0.25
    assert r.rho("gate", 7) == 0.75 and r.rho("gate", 6) == 0.5
    assert r.rho("q", 0) == 1.0  # unnamed: exact


@pytest.mark.parametrize("text", [None, "", "off", "none", "all=1.0", "mlp=1"])
def test_exact_is_none(text):
    assert parse_rmm(text) is None


def test_presets_parse_and_accept_overrides():
    for name in RMM_PRESETS:
        assert parse_rmm(name) is not None
    r = parse_rmm("products,qk=1.0,down=0.5")
    assert r.products() == {"qk": 1.0, "pv": 0.75} and r.rho("down", 2) == 0.5


@pytest.mark.parametrize("text,match", [
    ("bogus", "unknown preset"),
    ("mlp=0", r"\(0, 1\]"), ("mlp=1.5", r"\(0, 1\]"), ("mlp=nan", r"\(0, 1\]"), ("mlp=x", r"\(0, 1\]"),
    ("ffn=0.5", "unknown component"),
    ("mlp@5-2=0.5", "empty"),
    ("qk@0-3=0.5", "every layer"),
    ("mlp@a=0.5", "component@layers"),
])
def test_errors_are_one_line(text, match):
    with pytest.raises(MlxInferError, match=match) as e:
        parse_rmm(text)
    assert "\n" not in str(e.value)
