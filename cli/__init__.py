"""The mlx-infer command line (typer + rich), installed as `mlx_infer.cli`."""
