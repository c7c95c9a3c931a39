"""The mlx-infer command line (typer + rich), installed as `mlx_infer.cli`.

Each module has one job: `app` wires the commands, `options` holds the shared flags, `errors`
turns bad input into a one-line message and exit code 2, `progress` draws the loading bar, and
`generate`, `chat`, `doctor`, `convert` implement the commands over the Python API.
"""
