"""Named defaults of RMM."""

#: Presets of `--rmm` (expanded before the items that follow them), from bench/rmm.py's sweep on the default
#: model (docs/rmm.md): the settings that stayed within +2 perplexity. Neither saves time here: qk / pv run
#: on mx ops (no kernel skips the dropped work), and attn=0.9 reads only slightly fewer weight bytes.
RMM_PRESETS = {
    "products": "qk=0.75,pv=0.75",
    "attn-light": "attn=0.9",
}

#: The retention `speculative="rmm"` drafts with (the linear layers only: the reductions a kernel turns into
#: less work).
RMM_DRAFT = "attn=0.75,mlp=0.75"
