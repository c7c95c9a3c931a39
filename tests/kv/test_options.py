"""The paged cache's options parsed in plain Python: budgets with units or as a fraction of free memory,
POLICY:RATIO, block sizes; each bad value one MlxInferError line."""

import pytest

from mlx_infer.errors import MlxInferError
from mlx_infer.kv import options
from mlx_infer.kv.options import EvictSpec, check_block_size, check_kv_cache, parse_budget, parse_evict


@pytest.mark.parametrize("value, want", [
    (None, None), (4096, 4096), ("512MB", 512 * 10**6), ("512mb", 512 * 10**6), ("2GiB", 2 * 2**30),
    ("1.5 GB", 1_500_000_000), ("64k", 65536), ("1000", 1000), ("100KiB", 102400),
])
def test_budget_units(value, want):
    assert parse_budget(value) == want


def test_budget_fraction_of_free_memory(monkeypatch):
    monkeypatch.setattr(options, "free_memory_bytes", lambda: 8_000_000_000)
    assert parse_budget("0.5") == 4_000_000_000
    assert parse_budget(0.25) == 2_000_000_000
    assert parse_budget("1.0") == 8_000_000_000
    monkeypatch.setattr(options, "free_memory_bytes", lambda: 0)
    with pytest.raises(MlxInferError, match="unknown here"):
        parse_budget("0.5")


def test_free_memory_is_positive_here():
    assert options.free_memory_bytes() > 0


@pytest.mark.parametrize("value", ["12XB", "lots", "-5MB", "0", 0, -1, "1.5", 2.0, True, ""])
def test_bad_budgets(value):
    with pytest.raises(MlxInferError) as e:
        parse_budget(value)
    assert str(e.value).startswith("kv_budget") and "\n" not in str(e.value)


@pytest.mark.parametrize("value, want", [
    (None, None), ("none", None), ("h2o:0.5", EvictSpec("h2o", 0.5)), ("H2O:0.3", EvictSpec("h2o", 0.3)),
    ("scissorhands:0.7", EvictSpec("scissorhands", 0.7)), ("streaming:0.1", EvictSpec("streaming", 0.1)),
])
def test_evict_specs(value, want):
    assert parse_evict(value) == want


@pytest.mark.parametrize("value, message", [
    ("h2o", "POLICY:RATIO"), ("lru:0.5", "unknown eviction policy 'lru'"), ("h2o:x", "not a number"),
    ("h2o:0", "(0, 1)"), ("h2o:1", "(0, 1)"), ("h2o:1.2", "(0, 1)"),
])
def test_bad_evict_specs(value, message):
    with pytest.raises(MlxInferError) as e:
        parse_evict(value)
    assert message in str(e.value)


def test_kinds_and_block_sizes():
    assert check_kv_cache("Paged") == "paged" and check_kv_cache("dense") == "dense"
    assert check_block_size(16) == 16 and check_block_size("8") == 8
    for bad in (0, -4, "x", 2.5, True, "1.5"):
        with pytest.raises(MlxInferError, match="block_size"):
            check_block_size(bad)
    with pytest.raises(MlxInferError, match="dense, paged"):
        check_kv_cache("sparse")
