"""The --stats line of a speculative request (cli/stats.py)."""

from mlx_infer.cli.stats import format_stats
from mlx_infer.generation.results import GenerationStats


def test_rounds_without_a_draft_say_so():
    """--max-draft 0, or a lookup that never matched: no tau or empty acceptance list."""
    line = format_stats(GenerationStats(prompt_tokens=9, generated_tokens=10, spec_mode="lookup", tau=1.0,
                                        rounds=10, acceptance=[]))
    assert line.endswith("| spec lookup: no draft in 10 rounds (plain decoding)"), line


def test_rounds_with_drafts_give_tau_and_acceptance():
    line = format_stats(GenerationStats(prompt_tokens=9, generated_tokens=12, spec_mode="lookup", tau=1.5,
                                        rounds=8, draft_s=0.01, verify_s=0.2, acceptance=[0.5, 0.25]))
    assert "| spec lookup: tau 1.50, 8 rounds, draft 0.01 s, verify 0.20 s, acceptance by position [0.50 0.25]" in line
