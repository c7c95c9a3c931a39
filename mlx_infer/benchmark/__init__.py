"""`mlx-infer bench --suite ...`: the benchmark a user runs on their own machine.

Each suite times mlx-infer's Engine against its peers on the same weights, interleaved trial by trial in one
run: mlx-lm's own generation on the MLX directory the engine loaded (always there), and llama.cpp on the
same GGUF when llama-cpp-python is installed. Modules, one job each: prompts.py (the prompts shipped with
the package), timing.py (timed token streams, interleaved trials), peers.py (mlx-lm and llama.cpp),
machine.py (what ran it), suites.py (the suites), report.py (report.md, results.json, machine.json) and
plots.py (the PNGs; imports matplotlib, the optional `bench` extra, so only the report writer's caller
imports it).
"""
