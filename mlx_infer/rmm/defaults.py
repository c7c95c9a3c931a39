"""Named defaults of RMM."""

#: Presets of `--rmm` (expanded before the items that follow them). Chosen from bench/rmm.py's sweep on
#: the default model; docs/rmm.md has the numbers.
RMM_PRESETS = {
    "light": "mlp=0.75",
    "attn": "attn=0.5",
    "draft": "linear=0.5",
}

#: The retention `speculative="rmm"` drafts with.
RMM_DRAFT = "attn=0.75,mlp=0.75"
