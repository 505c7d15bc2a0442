"""The ops, one module each: its kernels, autograd, custom op and functional entry (`fused_kernels.ops.rms_norm`
is the module; `fused_kernels.rms_norm` the function). Each op's heuristics and launch tables, and its one
`plan(call, device)`, live beside it in `<op>_config.py`. The Gluon kernels of the shared-memory paths
(`norm_smem`, `cross_entropy_smem`) are imported on a first launch of those paths."""
