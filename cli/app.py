"""mlx-infer CLI entry point (placeholder until the CLI lands)."""


def main():
    raise SystemExit("mlx-infer CLI: not built yet")
