"""Reduced matrix multiplication (RMM, arXiv 2608.13426): input-adaptive contraction slices kept under a
retention ratio per component.

- `options`: `--rmm attn=0.5,mlp=0.9,qk=0.75,pv=1.0`, presets, per-layer overrides (`Retention`).
- `layers`: the reduced twins of QuantizedLinear (whole quantization groups, on the kernel layer's
  `rmm_qmm`) and Linear (single indices).
- `apply`: `reduce_model(model, retention)` in place, `reduced_view(model, retention)` sharing weights.
- `attention`: QK^T over head_dim and PV over tokens, inside the attention hook.
"""
