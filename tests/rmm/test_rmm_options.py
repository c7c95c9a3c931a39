"""`--rmm` parsing: components, groups, per-layer rules, presets, one-line errors, the canonical form, and
per-layer rules checked against a model's layer count."""

import mlx.nn as nn
import pytest

from mlx_infer.errors import MlxInferError
from mlx_infer.rmm.apply import layer_count, reduce_model, reduced_view
from mlx_infer.rmm.defaults import RMM_PRESETS
from mlx_infer.rmm.layers import RmmLinear
from mlx_infer.rmm.options import COMPONENTS, Retention, parse_rmm


def test_components_and_groups():
    r = parse_rmm("attn=0.5,mlp=0.9,qk=0.75,pv=1.0")
    assert [r.rho(c, 3) for c in ("q", "k", "v", "o")] == [0.5] * 4
    assert [r.rho(c, 3) for c in ("gate", "up", "down")] == [0.9] * 3
    assert r.products() == {"qk": 0.75, "pv": 1.0}
    assert r.text == "attn=0.5,mlp=0.9,qk=0.75,pv=1.0"  # as written
    assert str(r) == "attn=0.5,mlp=0.9,qk=0.75"  # canonical: pv=1.0 is exact


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
    ("mlp@5-2=0.5", "empty"), ("mlp@5-2=0.5", "lower layer first"),
    ("qk@0-3=0.5", "every layer"),
    ("mlp@a=0.5", "N, N-M or N-"), ("mlp@=0.5", "N, N-M or N-"), ("mlp@1-2-3=0.5", "N, N-M or N-"),
    # numbers are ASCII digits, in rho as in layers (full-width, Arabic-Indic, superscript digits)
    ("attn=\uff10.5", "ASCII digits"), ("attn=0.\u0665", "ASCII digits"), ("mlp=\u00b9", "ASCII digits"),
    ("mlp@\uff13=0.5", "ASCII digits"), ("mlp@0-\u0663=0.5", "ASCII digits"), ("mlp@\u0661-=0.5", "ASCII digits"),
    ("mlp=0.7_5", "ASCII digits"), ("mlp=inf", r"\(0, 1\]"),
    # every item between commas is there
    ("attn=0.5,", "empty item"), ("attn=0.5,,mlp=0.9", "empty item"), (",attn=0.5", "empty item"),
    (" , ", "empty item"), ("products,", "empty item"),
])
def test_errors_are_one_line(text, match):
    with pytest.raises(MlxInferError, match=match) as e:
        parse_rmm(text)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("value", [0.5, 1, 0, True, [0.5], ("attn=0.5",), {"attn": 0.5}])
def test_a_value_of_another_type_says_what_is_expected(value):
    with pytest.raises(MlxInferError, match=r'rmm must be a string like "attn=0.5,mlp=0.9" or a preset name') as e:
        parse_rmm(value)
    assert type(value).__name__ in str(e.value) and "\n" not in str(e.value)


def test_a_retention_is_taken_as_it_is():
    r = parse_rmm("mlp=0.5")
    assert parse_rmm(r) is r
    assert parse_rmm(Retention((("q", 0, None, 1.0),), "q=1")) is None  # exact


def test_ascii_numbers_are_accepted():
    assert parse_rmm("mlp=.5").rho("up", 0) == 0.5
    assert parse_rmm("mlp=5e-1").rho("up", 0) == 0.5
    assert parse_rmm("mlp=1, up= 0.25 ").rho("up", 3) == 0.25  # spaces around the number
    assert parse_rmm("down@12=0.5").rho("down", 12) == 0.5


@pytest.mark.parametrize("spellings, canonical", [
    (["mlp=0.9, attn=0.5", "attn=0.5,mlp=0.9", "ATTN=0.5,MLP=0.9", "q=0.5,k=0.5,v=0.5,o=0.5,mlp=0.9",
      "mlp=0.9,attn=0.25,attn=0.5", "attn=0.5,mlp=0.9,qk=1,pv=1.0", "mlp@0-=0.9,attn=0.50"], "attn=0.5,mlp=0.9"),
    (["attn=0.5,mlp=0.5", "linear=0.5", "mlp=0.5,attn=0.5"], "linear=0.5"),
    (["all=0.75", "linear=0.75,qk=0.75,pv=0.75", "products,linear=0.75"], "all=0.75"),
    (["products", "qk=0.75,pv=0.75", "pv=0.75,qk=0.75"], "qk=0.75,pv=0.75"),
    (["down@0-3=0.5,down@4-7=0.5", "down@0-7=0.5", "down@4-7=0.5,down@0-3=0.5", "down@0-9=0.5,down@8-9=1"],
     "down@0-7=0.5"),
    (["mlp=0.5,down@0-3=1.0,up@10-=0.25,gate@7=0.75", "mlp=0.5,up@10-=0.25,gate@7=0.75,down@0-3=1,up@12-=0.25"],
     "gate=0.5,gate@7=0.75,up=0.5,up@10-=0.25,down=0.5,down@0-3=1"),
    (["attn@2=0.5", "attn@2-2=0.5"], "attn@2=0.5"),
])
def test_canonical_form(spellings, canonical):
    """Every spelling of one retention gives the same canonical text (written out by hand here)."""
    assert {str(parse_rmm(s)) for s in spellings} == {canonical}


@pytest.mark.parametrize("text", ["mlp=0.9, attn=0.5", "mlp=0.5,down@0-3=1.0,up@10-=0.25,gate@7=0.75",
                                  "mlp=0.5,mlp@0-3=0.9,mlp@4-=0.9", "mlp@0-3=0.9,mlp@4-=0.9", "products,attn@3-5=0.125",
                                  "all=0.5,qk=1,down@2=0.3333333333"])
def test_canonical_form_parses_back_to_the_same_ratios(text):
    r = parse_rmm(text)
    back = parse_rmm(str(r))
    for component in COMPONENTS:
        for layer in [None, *range(40)]:
            assert back.rho(component, layer) == r.rho(component, layer), (component, layer, str(r))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up_proj = nn.Linear(8, 8)


class Stack(nn.Module):
    """A float model of `n` decoder layers with one `up_proj` each (paths layers.N.up_proj)."""

    def __init__(self, n: int):
        super().__init__()
        self.layers = [Block() for _ in range(n)]


def test_layer_ranges_are_checked_against_the_model():
    model = Stack(4)
    assert layer_count(model) == 4
    for text in ["up@4=0.5", "mlp@4-=0.5", "mlp@40-50=0.5"]:
        with pytest.raises(MlxInferError, match=r"this model has 4 layers \(0-3\)") as e:
            reduce_model(model, parse_rmm(text))
        assert text in str(e.value) and "\n" not in str(e.value)
        with pytest.raises(MlxInferError, match="4 layers"):
            reduced_view(model, parse_rmm(text))
    assert not any(isinstance(m, RmmLinear) for m in model.modules())  # refused before any swap
    # a range that reaches past the end still selects the layers that exist
    view = reduced_view(model, parse_rmm("up@2-9=0.5"))
    assert [isinstance(layer.up_proj, RmmLinear) for layer in view.layers] == [False, False, True, True]
    assert reduce_model(Stack(4), parse_rmm("up@3-=0.5,up=0.5")) == 4


def test_a_model_without_layers_refuses_layer_ranges():
    with pytest.raises(MlxInferError, match="no decoder layers"):
        reduce_model(nn.Sequential(nn.Linear(4, 4)), parse_rmm("up@0=0.5"))
