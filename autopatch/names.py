"""The kernel names users write (FUSED_KERNELS, AUTOPATCH_<KERNEL>, apply(**toggles)) and what each
replaces. The names are the ones Hugging Face's `TrainingArguments.liger_kernel_config` uses, so an
existing config dict carries over unchanged. No imports: start-up and config read this."""

KERNELS: dict[str, str] = {
    "rope": "module-level apply_rotary_pos_emb (half rotation, partial rotary, interleaved, GLM-style, de-interleaved MLA) -> fused_kernels.rope",
    "rms_norm": "RMSNorm classes' forward (Llama/Gemma casting, offset 0/1, per-head q/k norms) -> fused_kernels.rms_norm",
    "layer_norm": "LayerNorm: torch.nn.LayerNorm instances of a patched model (at build time or apply()) and the "
                  "LayerNorm classes of the modeling modules (weight/bias or not, fp32 upcast or not) -> "
                  "fused_kernels.layer_norm",
    "swiglu": "gated MLP forward with SiLU gate (gate_proj/up_proj or fused gate_up_proj) -> fused_kernels.swiglu; "
              "MoE experts modules with SiLU experts -> fused_kernels.moe_experts",
    "geglu": "gated MLP forward with a GELU gate (tanh or erf) -> fused_kernels.geglu; MoE experts modules with "
             "GELU experts -> fused_kernels.moe_experts",
    "gelu_mlp": "plain MLP forward second(gelu(first(x))) (fc1/fc2, c_fc/c_proj, dense_h_to_4h/dense_4h_to_h; "
                "GELU tanh, erf or quick; a trailing dropout): vision towers (CLIP, SigLIP, ViT), Phi, GPT-NeoX, GPT-2, "
                "StarCoder2 -> "
                "fused_kernels.gelu_linear (gelu(h) recomputed in the backward, not kept)",
    "cross_entropy": "the causal-LM loss where logits exist anyway (eval, no labels path) -> fused_kernels.cross_entropy",
    "fused_linear_cross_entropy": "*ForCausalLM forward in training with labels: lm_head + loss without full logits -> fused_kernels.fused_linear_cross_entropy",
    "causal_mask": "not a kernel: under torch.compile, SDPA keeps is_causal (no materialised [seq, seq] mask, "
                   "GQA kept) when a model forward gets no position_ids, attention_mask or cache -> "
                   "transformers' mask functions answer as in eager",
    "vision_attention": "not a kernel: vision towers' windowed attention under SDPA (Qwen2-VL-style cu_seqlens "
                        "windows: Qwen2/2.5/3-VL, Omni, GLM-4V, PaddleOCR-VL) -> the windows of one length in one SDPA call "
                        "instead of one call per window",
    "masked_attention": "not a kernel: SDPA under a boolean mask (sliding windows, image blocks, padding, packed "
                        "documents) -> one SDPA call per 1024-query block over only the keys its mask allows, "
                        "instead of the whole [queries, keys] square; with AUTOPATCH_ATTENTION_QUERY_BLOCK_TOKENS, long "
                        "causal attention in query blocks too (flash's backward workspace a block's)",
    "lora_input": "not a kernel: peft's LoRA Linear (one plain adapter) keeps its input in its own dtype "
                  "for the backward, not its float32 cast (recomputed there, in chunks); LoRA dropout's mask is drawn "
                  "again in the backward from the random state it was drawn from",
}

KERNEL_NAMES: tuple[str, ...] = tuple(KERNELS)

# Keys Liger-Kernel's apply_liger_kernel_to_* functions take that this library provides no kernel for:
# accepted wherever a kernel name is (apply(), FUSED_KERNELS), recorded as not provided here, never an
# error. They are not part of FUSED_KERNELS=all, which means every kernel listed in KERNELS.
NOT_PROVIDED: dict[str, str] = {
    "relu_squared": "Nemotron's squared-ReLU MLP activation (Liger's key): no fused kernel for it here; the "
                    "original code runs",
}

# What each kernel name launches, by the op names fused_kernels counts (fused_kernels.launch_counts():
# "rms_norm_fwd", "gelu_bwd", ...). A kernel's `runs` in the report is the sum of its FORWARD ops (one
# per call of a patched component) plus the calls a rule counted itself; LAUNCH_OPS lists every op, the
# forward ones first (a backward that recomputes the forward counts it as <op>_recompute, not a call). A gelu_mlp component launches gelu_fwd/gelu_bwd (fused_kernels.gelu_linear); a
# gated MLP through glu_linear launches swiglu_*/geglu_*; MoE experts launch moe_experts_* for SiLU
# (swiglu) and GELU (geglu) experts alike. The non-kernels (causal_mask, vision_attention,
# masked_attention, lora_input) launch nothing of ours: their rules count the calls that took the patched path.
FORWARD_OPS: dict[str, tuple[str, ...]] = {
    "rope": ("rope_fwd",),
    "rms_norm": ("rms_norm_fwd",),
    "layer_norm": ("layer_norm_fwd",),
    "swiglu": ("swiglu_fwd", "moe_experts_fwd"),
    "geglu": ("geglu_fwd", "moe_experts_fwd"),
    "gelu_mlp": ("gelu_fwd",),
    "cross_entropy": ("cross_entropy_fwd",),
    "fused_linear_cross_entropy": ("fused_linear_cross_entropy_fwd",),
    "causal_mask": (),
    "vision_attention": (),
    "masked_attention": (),
    "lora_input": (),
}
LAUNCH_OPS: dict[str, tuple[str, ...]] = {  # + the backward and a backward's recomputation of the forward
    kernel: ops + tuple(op[: -len("_fwd")] + end for end in ("_bwd", "_recompute") for op in ops)
    for kernel, ops in FORWARD_OPS.items()
}
# Ops several kernel names launch (moe_experts_fwd: SiLU and GELU experts): a launch is credited to the
# kernel(s) among them that patched something in the process.
SHARED_OPS: frozenset[str] = frozenset(
    op for op in {o for ops in LAUNCH_OPS.values() for o in ops}
    if sum(op in ops for ops in LAUNCH_OPS.values()) > 1
)
# Not kernels: nothing launches, and a patched record's runs are the calls their rules count (None
# where the rule counts nothing).
UNCOUNTED: frozenset[str] = frozenset({"causal_mask"})
LOSS_KERNELS: tuple[str, ...] = ("fused_linear_cross_entropy", "cross_entropy")

# Modules of other libraries that a rule patches, and that rule's name (autopatch.rules): the import
# hooks run that rule alone over the module when it is imported; the audit watches its classes in the
# models that hold them.
LIBRARY_MODULES: dict[str, str] = {
    "peft.tuners.lora.layer": "lora",
}


def is_model_module(name: str) -> bool:
    """A module that defines model classes: transformers.models.*.modeling_*, or remote code's
    modeling_* (transformers_modules.*); not transformers' own modeling_utils and the like, not torch's."""
    if not name.rpartition(".")[2].startswith("modeling_"):
        return False
    return name.startswith("transformers.models.") or not name.startswith(("transformers.", "torch."))
