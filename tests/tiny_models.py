"""Tiny random models of any transformers causal-LM architecture, built from its own config class.

Used by the tests (tests/test_coverage_subset.py, tests/test_api_liger.py) and the coverage matrix
(dev/coverage_matrix.py, which puts tests/ on sys.path for it): nothing is downloaded, every size is shrunk so a forward and backward take milliseconds on the CPU. The sizes
are data (SHRINK); the generic retries below are what makes ~150 architectures build without a line
of per-model code.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import re
from types import ModuleType

import torch

# attribute name -> tiny value; applied only where the architecture's config has that attribute.
SHRINK: dict[str, object] = {
    "vocab_size": 256,
    "vocab_size_per_layer_input": 256,  # Gemma 3n / 4 per-layer embeddings (262144 x layers x 256 otherwise)
    "num_kv_shared_layers": 0,  # Gemma 3n / 4: the last 15 of 35 layers reuse earlier KV; 4 layers cannot
    "hidden_size": 64,
    "d_model": 64,
    "n_embd": 64,
    "embed_dim": 64,  # Kosmos2 / Kosmos2.5 text models
    "intermediate_size": 128,
    "ffn_dim": 128,  # OPT, XGLM, Kosmos2
    "ffn_hidden_size": 128,
    "n_inner": 128,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "expert_intermediate_size": 32,
    "num_hidden_layers": 4,
    "n_layer": 4,
    "n_layers": 4,  # DBRX, MPT
    "num_layers": 4,
    "num_attention_heads": 4,
    "n_head": 4,
    "n_heads": 4,  # DBRX, MPT
    "num_key_value_heads": 2,
    "num_kv_heads": 2,
    "kv_n_heads": 2,  # DBRX attn_config
    "head_dim": 16,
    "kv_channels": 16,
    "max_position_embeddings": 128,
    "n_positions": 128,
    "max_seq_len": 128,  # DBRX, MPT
    "hidden_size_global": 64,  # BLT local encoder / decoder: must equal the global transformer's hidden_size
    "encoder_hash_byte_group_vocab": 256,  # BLT hash n-gram embeddings (6 tables x 500002 rows otherwise)
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "moe_num_experts": 4,
    "num_experts_per_tok": 2,
    "num_experts_per_token": 2,  # Kimi-Linear, Bailing
    "moe_k": 2,  # Ernie 4.5 MoE
    "moe_topk": 2,
    "top_k": 2,
    "n_group": 1,
    "num_expert_group": 1,
    "topk_group": 1,
    "n_shared_experts": 1,
    "num_shared_experts": 1,
    "moe_num_shared_experts": 1,
    "kv_lora_rank": 16,
    "q_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
    "sliding_window": 16,
    "attention_chunk_size": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_num_heads": 4,  # Kimi-Linear, Bailing hybrid
    "linear_head_dim": 16,
    "mamba_n_heads": 4,
    "mamba_d_head": 32,
    "mamba_d_state": 8,
    "mamba_n_groups": 1,
    "mamba_expand": 2,
    "ssm_state_size": 8,
    "state_size": 8,
    "n_groups": 1,
    "time_step_rank": 8,
    "conv_kernel": 4,
    "num_nextn_predict_layers": 0,
    "rotary_dim": 8,
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
    "encoder_layers": 2,
    "decoder_layers": 2,
    "encoder_ffn_dim": 128,
    "decoder_ffn_dim": 128,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

# Probabilities that would make a tiny model stochastic or skip layers: switch them off.
ZERO = re.compile(r".*(dropout|drop_rate|dropout_rate|pdrop|dropout_prob|drop_prob|drop_path_rate|layerdrop)$")
ID_ATTRS = ("pad_token_id", "bos_token_id", "eos_token_id", "sep_token_id", "decoder_start_token_id")
LAYER_LISTS = ("layer_types", "layers_block_type", "hybrid_override_pattern", "block_types")


@dataclasses.dataclass
class Architecture:
    model_dir: str  # "llama"
    module_name: str  # "transformers.models.llama.modeling_llama"
    class_name: str  # "LlamaForCausalLM"


def causal_lm_architectures() -> list[Architecture]:
    """Every `*ForCausalLM` class in the installed transformers, found by reading modeling sources
    (no import, no hand-typed list)."""
    import transformers

    root = os.path.dirname(transformers.models.__file__)
    found = []
    for model_dir in sorted(os.listdir(root)):
        folder = os.path.join(root, model_dir)
        if not os.path.isdir(folder) or model_dir == "auto":
            continue
        for fname in sorted(os.listdir(folder)):
            if not (fname.startswith("modeling_") and fname.endswith(".py")):
                continue
            with open(os.path.join(folder, fname), encoding="utf-8") as f:
                src = f.read()
            for m in re.finditer(r"^class (\w+ForCausalLM)\(", src, re.M):
                found.append(Architecture(model_dir, f"transformers.models.{model_dir}.{fname[:-3]}", m.group(1)))
    return found


# Fields whose default None some modeling code reads as a number without deriving it (Ministral's
# head_dim, Nemotron's num_key_value_heads, DeepSeek-V2's num_experts_per_tok): given the tiny value,
# which equals what a derivation would give (hidden 64 / 4 heads = 16) or is a valid choice. Not
# sliding_window and the like, where None means "off".
FILL_NONE = ("head_dim", "num_key_value_heads", "num_experts_per_tok", "topk_group", "n_group", "n_routed_experts",
             "n_shared_experts")

# Per-architecture fields (by the config class's model_type, sub-configs included) where the default
# config cannot build or run a model at all: released checkpoints' values where they are known (DBRX),
# else the smallest valid ones. Applied over the shrunk values; a dict merges into the sub-config's
# kwargs, a layer list is cut like the defaults are.
OVERRIDES: dict[str, dict[str, object]] = {
    # the per-layer-type RoPE table defaults to {} and the rotary embedding indexes it by layer type
    "cohere_compass_text": {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
    # the attention reads attn_config.rope_theta (no such field) and clamps q/k/v with clip_qkv=None
    "dbrx": {"attn_config": {"rope_theta": 500000.0, "clip_qkv": 8.0}},
    # 197 image tokens at 224 px; the causal-LM loss needs pixel_values (INPUT_LAYOUTS)
    "git_vision_model": {"image_size": 32},
    # layer_types defaults to None and nothing derives it: LFM2's conv / attention pattern
    "lfm2_moe": {"layer_types": ["conv", "conv", "full_attention", "conv"] * 8},
    # indexed_attention layers (the only attention) always build the QSA indexer, whose fields default to None
    "qwen4_exp_text": {"indexer_n_heads": 4, "indexer_kv_heads": 1, "indexer_head_dim": 16, "indexer_budget": 4,
                       "indexer_compress_ratio": 2},
    # the language adapters need a language when no lang_ids are passed
    "xmod": {"default_language": "en_XX"},
}

# Architectures whose training forward takes more than (batch, seq) token ids: model_type -> layout.
#   codebooks     input_ids (batch * num_codebooks, seq), labels (batch, seq, num_codebooks) (MusicGen)
#   pixel_values  plus a random image batch of vision_config's size (GIT's loss skips the image tokens)
INPUT_LAYOUTS = {
    "musicgen_decoder": "codebooks",
    "musicgen_melody_decoder": "codebooks",
    "git": "pixel_values",
}


def _shrunk_kwargs(config_cls, n_layers: int) -> dict:
    default = config_cls()
    values = default.to_dict()
    kwargs: dict = {}
    for name, value in values.items():
        if name in SHRINK and not isinstance(value, (dict, list)) and (value is not None or name in FILL_NONE):
            kwargs[name] = SHRINK[name]
        elif ZERO.match(name) and isinstance(value, (int, float)) and not isinstance(value, bool):
            kwargs[name] = type(value)(0)
        elif isinstance(value, dict) and name.endswith("_config") and hasattr(default, name):
            sub = getattr(default, name)
            if hasattr(sub, "to_dict") and type(sub).__name__.endswith("Config"):
                kwargs[name] = _shrunk_kwargs(type(sub), n_layers)
    if "qk_rope_head_dim" in kwargs and "head_dim" in kwargs:
        kwargs["head_dim"] = kwargs["qk_rope_head_dim"]  # MLA: the rotary embedding is sized by head_dim
    if "kv_lora_rank" in kwargs and "num_key_value_heads" in kwargs:
        kwargs["num_key_value_heads"] = kwargs["num_attention_heads"]  # MLA expands k/v to every head
    if {"num_heads", "head_dim", "expand"} <= set(values) and "hidden_size" in kwargs:
        # Mamba-2 validates num_heads * head_dim == expand * hidden_size
        kwargs["num_heads"] = kwargs["hidden_size"] * values["expand"] // kwargs.get("head_dim", values["head_dim"])
    for name in ("num_hidden_layers", "n_layer", "n_layers", "num_layers"):
        if name in kwargs:
            kwargs[name] = n_layers
    types = values.get("attention_types")
    if isinstance(types, list) and types and all(isinstance(t, list) and len(t) == 2 for t in types):
        # GPT-Neo's [[pattern, repeats], ...], which must expand to exactly one entry per layer
        pattern = types[0][0]
        if isinstance(pattern, list) and pattern and n_layers % len(pattern) == 0:
            kwargs["attention_types"] = [[pattern, n_layers // len(pattern)]]
    for name in LAYER_LISTS:
        value = values.get(name)
        if isinstance(value, (list, str)) and len(value) > 0:
            kwargs[name] = _cut_layer_pattern(value, n_layers)
    for name, value in OVERRIDES.get(getattr(config_cls, "model_type", ""), {}).items():
        if name in LAYER_LISTS:
            value = _cut_layer_pattern(value, n_layers)
        elif isinstance(value, dict) and isinstance(kwargs.get(name), dict):
            value = {**kwargs[name], **value}
        kwargs[name] = value
    return kwargs


def _cut_layer_pattern(pattern, n_layers: int):
    """Keep the first n entries of a per-layer pattern, making sure an attention layer is among
    them (hybrid models put attention late)."""
    items = list(pattern)
    cut = items[:n_layers]
    attention = [x for x in items if "attention" in str(x).lower() or str(x) in ("*", "attn")]
    if attention and not any(x in attention for x in cut):
        cut[-1] = attention[0]
    return "".join(cut) if isinstance(pattern, str) else cut


# Overrides that most often clash with an architecture's own validation; dropped one at a time
# (the config then keeps its default for that field) when the full set does not build and run.
RISKY = ("head_dim", "num_key_value_heads", "num_experts_per_tok", "top_k", "moe_topk", "rotary_dim",
         "intermediate_size", "mamba_d_head", "mamba_n_heads", "kv_lora_rank", "q_lora_rank",
         "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "sliding_window", "num_attention_heads")


def config_variants(config_cls, n_layers: int = 4):
    """Candidate tiny kwargs for `config_cls`, best first: all overrides, then each risky one
    dropped, then a deeper stack (hybrid models whose first layers hold no attention)."""
    kwargs = _shrunk_kwargs(config_cls, n_layers)
    yield kwargs
    for key in RISKY:
        if key in kwargs:
            yield {k: v for k, v in kwargs.items() if k != key}
    mla = [k for k in ("head_dim", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "kv_lora_rank", "q_lora_rank") if k in kwargs]
    if mla:
        yield {k: v for k, v in kwargs.items() if k not in mla}
    yield _shrunk_kwargs(config_cls, 8)


def _finish(config):
    for name in ZERO_AFTER:
        if hasattr(config, name) and isinstance(getattr(config, name), float):
            setattr(config, name, 0.0)
    if hasattr(config, "_attn_implementation"):
        try:
            config._attn_implementation = "eager"
        except Exception:  # noqa: BLE001 - some configs freeze it; eager is only a preference
            pass
    return config


ZERO_AFTER = ("attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop")


def smoke_inputs(model, batch: int = 2, seq: int = 8, seed: int = 0):
    """Random token ids inside the tiny vocabulary (above the special ids), labels = ids; laid out
    as INPUT_LAYOUTS says for the architectures that need more."""
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab = getattr(text, "vocab_size", None) or 256
    layout = INPUT_LAYOUTS.get(getattr(config, "model_type", ""))
    g = torch.Generator().manual_seed(seed)
    if layout == "codebooks":
        codes = torch.randint(3, min(vocab, 256), (batch, config.num_codebooks, seq), generator=g)
        return {"input_ids": codes.reshape(-1, seq), "labels": codes.transpose(1, 2).contiguous(), "use_cache": False}
    ids = torch.randint(3, min(vocab, 256), (batch, seq), generator=g)
    inputs = {"input_ids": ids, "labels": ids.clone(), "use_cache": False}
    if layout == "pixel_values":
        vision = config.vision_config
        inputs["pixel_values"] = torch.randn(batch, vision.num_channels, vision.image_size, vision.image_size,
                                             generator=g)
    return inputs


def build_tiny(arch: Architecture, dtype=torch.float32, seed: int = 0, check: bool = True):
    """Import the architecture's module and build a tiny random model; with `check`, the first
    config variant whose model also runs a forward and backward wins. Raises RuntimeError with the
    first variant's error when none does."""
    module: ModuleType = importlib.import_module(arch.module_name)
    model_cls = getattr(module, arch.class_name)
    config_cls = model_cls.config_class
    first_error = None
    for kwargs in config_variants(config_cls):
        try:
            config = _finish(config_cls(**kwargs))
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                model = model_cls(config).to(dtype)
                if check:
                    model(**smoke_inputs(model)).loss.backward()
                    model.zero_grad(set_to_none=True)
            return model
        except Exception as exc:  # noqa: BLE001 - try the next variant, report the first error
            if first_error is None:
                first_error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
    raise RuntimeError(f"could not build a tiny {arch.class_name}: {first_error}")
