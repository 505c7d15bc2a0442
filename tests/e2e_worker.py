"""Worker process for tests/test_e2e_env.py (not a test module itself).

    python tests/e2e_worker.py OUT.pt [--models llama,qwen3,...] [--apply llama,...]

For each tiny model (built from its config with a fixed seed, float32, eager attention) it runs one
training step's forward+backward with labels (some ignored: -100) and one eval forward with labels
(full logits), and saves the loss, the eval loss, the logits, every parameter gradient, the Triton
launches per model (fused_kernels.launch_counts(), when loaded) and autopatch's records (when it was
loaded). Nothing here imports autopatch, except with --apply: after every model was measured, the
models named there are patched with `autopatch.apply(model)` and measured again.
"""

from __future__ import annotations

import argparse
import sys

import torch

COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=64)


def build(name: str):
    import transformers as tf

    if name == "llama":
        config = tf.LlamaConfig(**COMMON)
        cls = tf.LlamaForCausalLM
    elif name == "qwen3":
        config = tf.Qwen3Config(**COMMON)
        cls = tf.Qwen3ForCausalLM
    elif name == "gemma2":  # offset-1 norms, GELU-tanh MLP, final-logit softcap, tied embeddings
        config = tf.Gemma2Config(**COMMON, query_pre_attn_scalar=16, sliding_window=16,
                                 final_logit_softcapping=30.0, attn_logit_softcapping=50.0)
        cls = tf.Gemma2ForCausalLM
    elif name == "mistral":
        config = tf.MistralConfig(**COMMON, sliding_window=16)
        cls = None  # through the Auto class, as most training scripts build it
    elif name == "phi3":  # fused gate_up_proj, partial rotary
        config = tf.Phi3Config(**{k: v for k, v in COMMON.items() if k != "head_dim"},
                               partial_rotary_factor=0.5, pad_token_id=0, bos_token_id=1, eos_token_id=2)
        cls = tf.Phi3ForCausalLM
    elif name == "qwen3_moe":  # experts module (fused experts), router aux loss off
        config = tf.Qwen3MoeConfig(**COMMON, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2)
        cls = tf.Qwen3MoeForCausalLM
    else:
        raise ValueError(f"unknown model {name!r}")
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config) if cls is None else cls(config)
    return model.float()


def batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (2, 12), generator=g)
    labels = ids.clone()
    labels[0, :5] = -100  # ignored positions
    labels[1, -3:] = -100
    return ids, labels


def launches() -> dict:
    fused = sys.modules.get("fused_kernels")
    return dict(fused.launch_counts()) if fused is not None else {}


def measure(model) -> dict:
    ids, labels = batch()
    model.zero_grad(set_to_none=True)
    before = launches()
    model.train()
    out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.eval()
    with torch.no_grad():
        ev = model(input_ids=ids, labels=labels)
    after = launches()
    return {
        "loss": out.loss.detach().clone(),
        "eval_loss": ev.loss.detach().clone(),
        "logits": ev.logits.detach().clone(),
        "grads": grads,
        "n_params": sum(1 for _ in model.parameters()),
        "launches": {k: after.get(k, 0) - before.get(k, 0) for k in after if after.get(k, 0) != before.get(k, 0)},
    }


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--models", default="llama,qwen3,gemma2,mistral,phi3,qwen3_moe")
    p.add_argument("--apply", default="", help="models to measure again after autopatch.apply(model), once "
                   "every model was measured (so the other measurements stay unpatched)")
    args = p.parse_args()
    results: dict = {"models": {}, "applied": {}}
    models = {}
    for name in args.models.split(","):
        models[name] = build(name)
        results["models"][name] = measure(models[name])
    for name in filter(None, args.apply.split(",")):
        import autopatch

        autopatch.apply(models[name])
        results["applied"][name] = measure(models[name])
    autopatch = sys.modules.get("autopatch")
    results["records"] = [r.as_dict() for r in autopatch.applied()] if autopatch is not None else []
    torch.save(results, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
