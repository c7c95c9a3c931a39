"""The KV cache flags: bad values are one `error:` line with exit 2 before the model loads; a paged run's
--json carries the kv object and --stats prints its line."""

import json

import pytest
from cli_helpers import assert_user_error


@pytest.mark.parametrize("args, message", [
    (["generate", "hi", "--kv-cache", "sparse"], "--kv-cache must be one of dense, paged"),
    (["generate", "hi", "--kv-cache", "paged", "--kv-budget", "12XB"], "--kv-budget '12XB' does not parse"),
    (["generate", "hi", "--kv-cache", "paged", "--kv-budget", "1.5"], "in (0, 1]"),
    (["generate", "hi", "--kv-cache", "paged", "--evict", "lru:0.5"], "unknown eviction policy 'lru'"),
    (["generate", "hi", "--kv-cache", "paged", "--evict", "h2o:1.5"], "must be in (0, 1)"),
    (["generate", "hi", "--kv-cache", "paged", "--evict", "h2o"], "POLICY:RATIO"),
    (["generate", "hi", "--kv-cache", "paged", "--evict", " "], "--evict needs POLICY:RATIO (e.g. h2o:0.5), or none"),
    (["generate", "hi", "--kv-cache", "paged", "--evict", "h2o:0.5", "--repack", "maybe"], "--repack must be on or off"),
    (["generate", "hi", "--kv-cache", "paged", "--block-size", "0"], "--block-size must be an integer >= 1"),
    (["generate", "hi", "--evict", "h2o:0.5"], "--evict needs --kv-cache paged"),
    (["generate", "hi", "--kv-budget", "1GB"], "--kv-budget needs --kv-cache paged"),
    (["generate", "hi", "--kv-cache", "paged", "--evict", "h2o:0.5", "--spec", "lookup"], "not supported yet"),
    (["chat", "--kv-cache", "paged", "--evict", "nope:0.3"], "unknown eviction policy"),
    (["chat", "--kv-cache", "paged", "--block-size", "x"], "--block-size"),
    (["generate", "hi", "--kv-bits", "3"], "--kv-bits must be 8, 4 or kXvY"),
    (["generate", "hi", "--kv-bits", "8", "--kv-scheme", "nf4"], "--kv-scheme must be one of affine, kivi"),
    (["generate", "hi", "--kv-scheme", "kivi"], "give --kv-bits"),
    (["generate", "hi", "--kv-bits", "8", "--kv-quant-start", "\u00b2"], "--kv-quant-start must be an integer"),
    (["generate", "hi", "--kv-bits", "8", "--kv-quant-start", "x"], "--kv-quant-start must be an integer"),
    (["chat", "--kv-bits", "4", "--kv-scheme", "kivi", "--kv-cache", "paged"],
     "--kv-scheme kivi quantizes keys per channel along tokens, which does not fit the paged cache's token blocks: "
     "use --kv-scheme affine with --kv-cache paged"),
    (["generate", "hi", "--kv-bits", "8", "--kv-quant-start", "64", "--kv-cache", "paged"],
     "--kv-quant-start 64 (a float prefix) needs the dense KV cache"),
])
def test_bad_kv_flags_fail_before_loading(run_cli, args, message):
    assert_user_error(run_cli(*args, "-m", "/definitely/not/here.gguf"), message)


@pytest.mark.parametrize("command", [["generate", "hi"], ["chat"]])
def test_budget_under_one_block_fails_at_load_in_flag_words(run_cli, command):
    """A --kv-budget that cannot hold one KV block is refused once the model is loaded (the block's size is
    known), before any request, in the command line's words; chat no longer fails every turn and exits 0."""
    proc = run_cli(*command, "-n", "4", "--kv-cache", "paged", "--kv-budget", "4KB", input="hi\n")
    assert_user_error(proc, "the KV budget of 3.9 KiB (smaller than one block of 16 tokens, which takes 720.0 KiB "
                            "with this model) holds no KV block: raise --kv-budget")


def test_paged_json_and_stats(run_cli):
    proc = run_cli("generate", "Name three colors.", "-n", "12", "--kv-cache", "paged", "--evict", "h2o:0.5",
                   "--json", "--stats")
    assert proc.returncode == 0, proc.stderr
    kv = json.loads(proc.stdout)["stats"]["kv"]
    assert kv["evict"] == "h2o:0.5" and kv["repack"] is True and kv["block_size"] == 16
    assert kv["evicted_tokens"] > 0 and kv["live_tokens"] > 0 and kv["peak_kv_bytes"] > 0
    assert "kv paged (block 16)" in proc.stderr and "evict h2o:0.5" in proc.stderr


def test_repack_off_without_evict_is_a_warning(run_cli):
    proc = run_cli("generate", "Hi", "-n", "2", "--kv-cache", "paged", "--repack", "off")
    assert proc.returncode == 0, proc.stderr
    assert "warning: --repack off has no effect without --evict POLICY:RATIO" in proc.stderr


def test_dense_json_has_no_kv(run_cli):
    proc = run_cli("generate", "Hi", "-n", "2", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["stats"]["kv"] is None


def test_over_budget_is_one_error_line(run_cli):
    proc = run_cli("generate", "Name three colors.", "-n", "200", "--kv-cache", "paged", "--kv-budget", "1MB")
    assert_user_error(proc, "KV budget")


def test_paged_quantized_kv_json_and_stats(run_cli):
    """generate --kv-cache paged --kv-bits 8: the pool's token slot is 30 layers x 3 KV heads x (64 + 64 bytes
    of codes + 2 x 2 float16 scale / bias pairs), what the dense 8-bit cache reports too."""
    proc = run_cli("generate", "Name three colors.", "-n", "8", "--kv-cache", "paged", "--kv-bits", "8", "--json")
    assert proc.returncode == 0, proc.stderr
    stats = json.loads(proc.stdout)["stats"]
    assert stats["kv_bits"] == "8" and stats["kv_bytes_per_token"] == 30 * 3 * (64 + 64 + 2 * 2 * 2)
    assert stats["kv"]["peak_kv_bytes"] == stats["kv"]["retained_blocks_max"] * 16 * 12240


def test_quantized_kv_json_and_stats(run_cli):
    proc = run_cli("generate", "Name three colors.", "-n", "8", "--kv-bits", "k8v4", "--json", "--stats")
    assert proc.returncode == 0, proc.stderr
    stats = json.loads(proc.stdout)["stats"]
    assert stats["kv_bits"] == "k8v4" and stats["kv_bytes_per_token"] == 30 * 3 * (64 + 32 + 2 * 2 * 2)
    assert "kv quantized k8v4: 9360 B/token" in proc.stderr


def test_bench_kv_bits(run_cli):
    """bench --kv-bits times every mode over the quantized KV cache (the JSON names it); a bad value is one
    error line before the model loads."""
    proc = run_cli("bench", "Name three colors.", "-n", "4", "-t", "1", "--spec", "off", "--kv-bits", "4", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["kv_bits"] == "4" and out["rows"][0]["identical"] and out["rows"][0]["tokens"] >= 1
    proc = run_cli("bench", "Name three colors.", "-n", "4", "-t", "1", "-c", "2", "--kv-bits", "8", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["kv_bits"] == "8"
    assert_user_error(run_cli("bench", "--kv-bits", "3", "-m", "/definitely/not/here.gguf"), "--kv-bits must be 8, 4")
