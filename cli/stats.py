"""Generation stats, printed on stderr (never stdout, which carries only the answer)."""

from typing import TYPE_CHECKING, Optional

from .progress import stderr

if TYPE_CHECKING:
    from mlx_infer.engine import GenerationStats


def format_stats(stats: "GenerationStats") -> str:
    """One line: prompt tokens (and how many came from the kept cache) / generated tokens, TTFT, prefill and decode speed, peak memory, and for speculative
    decoding the drafter, tau, rounds, draft / verify time and per-position acceptance; then a
    line for RMM (its retention), one for quantized KV (its setting and bytes per token), and for the paged KV cache: retained blocks (average and end), live tokens, waste, peak KV bytes, eviction and repacks."""
    line = (
        f"prompt {stats.prompt_tokens} tok{f' ({stats.cached_prompt_tokens} cached)' if stats.cached_prompt_tokens else ''}, "
        f"generated {stats.generated_tokens} tok | "
        f"TTFT {stats.ttft_s:.3f} s | prefill {stats.prefill_tps:.1f} tok/s | "
        f"decode {stats.decode_tps:.1f} tok/s | peak memory {stats.peak_memory_bytes / 2**20:.1f} MiB"
    )
    if stats.spec_mode:
        line += f" | spec {stats.spec_mode}"
        if stats.rounds and not stats.acceptance:  # e.g. --max-draft 0, or lookup never matched
            line += f": no draft in {stats.rounds} rounds (plain decoding)"
        elif stats.rounds:
            rates = " ".join(f"{a:.2f}" for a in stats.acceptance)
            line += (f": tau {stats.tau:.2f}, {stats.rounds} rounds, draft {stats.draft_s:.2f} s, "
                     f"verify {stats.verify_s:.2f} s, acceptance by position [{rates}]")
    if stats.rmm is not None:
        line += f"\nrmm {stats.rmm} (lossy)"
    if stats.kv_bits is not None:
        line += f"\nkv quantized {stats.kv_bits}: {stats.kv_bytes_per_token:.0f} B/token"
    if stats.kv is not None:
        kv = stats.kv
        line += (f"\nkv paged (block {kv['block_size']}): {kv['retained_blocks']:.1f} blocks on average, "
                 f"{kv['retained_blocks_end']} at the end, {kv['live_tokens']} live tok, waste {kv['waste']:.2f}, "
                 f"peak {kv['peak_kv_bytes'] / 2**20:.1f} MiB"
                 + (f" | evict {kv['evict']}: {kv['evicted_tokens']} tok, repack "
                    f"{'on' if kv['repack'] else 'off'} ({kv['repacks']} in {kv['repack_s']:.3f} s)" if kv['evict'] else ""))
    return line


def print_stats(stats: Optional["GenerationStats"]) -> None:
    """Print `format_stats` dimmed on stderr (nothing when there are no stats)."""
    if stats is not None:
        stderr.print(f"[dim]{format_stats(stats)}[/dim]")
