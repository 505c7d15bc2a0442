"""Worker for the training-stack tests (not a test module itself), in the pattern of tests/e2e_worker.py:
the same function runs in the test process (plain, or after autopatch.apply) and in a fresh process
that imports nothing from autopatch (patched by the environment alone), and saves what it measured.

    python tests/stack_worker.py trainer OUT.pt OUTPUT_DIR      (also under `accelerate launch`)

`trainer`: Hugging Face Trainer on a tiny Llama (from a config, fixed seed, float32, CPU), a synthetic
dataset of variable-length sequences padded per batch (padding labelled -100), gradient accumulation 2,
so Trainer counts num_items_in_batch over both micro-batches and the model divides by it. Saves the
per-step logged losses, the final parameters, the Triton launches and autopatch's records.
"""

from __future__ import annotations

import os
import sys

import torch

TINY_LLAMA = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=64, tie_word_embeddings=False)
PAD_ID = 0


def tiny_llama(seed: int = 0, **overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{**TINY_LLAMA, **overrides}, pad_token_id=PAD_ID)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).float()


def launches() -> dict:
    fused = sys.modules.get("fused_kernels")
    return dict(fused.launch_counts()) if fused is not None else {}


def records() -> list:
    autopatch = sys.modules.get("autopatch")
    return [r.as_dict() for r in autopatch.applied()] if autopatch is not None else []


class VariableLengthDataset(torch.utils.data.Dataset):
    """Sequences of 4..12 random tokens; labels = ids, with a random prompt prefix ignored (-100)."""

    def __init__(self, n: int = 16, seed: int = 1):
        g = torch.Generator().manual_seed(seed)
        self.items = []
        for _ in range(n):
            length = int(torch.randint(4, 13, (1,), generator=g))
            ids = torch.randint(3, TINY_LLAMA["vocab_size"], (length,), generator=g)
            labels = ids.clone()
            labels[: int(torch.randint(0, 3, (1,), generator=g))] = -100
            self.items.append({"input_ids": ids, "labels": labels})

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def pad_collate(features: list[dict]) -> dict:
    """Right-pad to the longest sequence of the batch: pad id in input_ids, -100 in labels, 0 in the
    attention mask (so every batch has a different number of counted targets)."""
    longest = max(len(f["input_ids"]) for f in features)
    ids = torch.full((len(features), longest), PAD_ID, dtype=torch.long)
    labels = torch.full((len(features), longest), -100, dtype=torch.long)
    mask = torch.zeros((len(features), longest), dtype=torch.long)
    for row, f in enumerate(features):
        n = len(f["input_ids"])
        ids[row, :n] = f["input_ids"]
        labels[row, :n] = f["labels"]
        mask[row, :n] = 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def train_with_trainer(output_dir: str, apply_config: dict | None = None, steps: int = 2) -> dict:
    """`steps` optimizer steps of Trainer (batch 2, gradient accumulation 2) from a fixed start.
    With `apply_config`, autopatch.apply(trainer.model, **apply_config) runs before training."""
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(
        output_dir=output_dir, use_cpu=True, report_to=[], save_strategy="no", logging_steps=1,
        max_steps=steps, per_device_train_batch_size=2, gradient_accumulation_steps=2, learning_rate=1e-3,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, seed=0, data_seed=0,
        dataloader_num_workers=0, remove_unused_columns=False, disable_tqdm=True,
    )
    from helpers import loss_logger

    log = loss_logger()
    trainer = Trainer(model=tiny_llama(), args=args, train_dataset=VariableLengthDataset(),
                      data_collator=pad_collate, callbacks=[log])
    if apply_config is not None:
        import autopatch

        autopatch.apply(trainer.model, **apply_config)
    before = launches()
    trainer.train()
    after = launches()
    return {
        "losses": log.losses,
        "params": {n: p.detach().clone() for n, p in trainer.model.named_parameters()},
        "accepts_loss_kwargs": trainer.model_accepts_loss_kwargs,
        "launches": {k: after.get(k, 0) - before.get(k, 0) for k in after if after.get(k, 0) != before.get(k, 0)},
        "records": records(),
        "pid": os.getpid(),
        "parent_pid": os.getppid(),
    }


def main(argv: list[str]) -> int:
    mode, out, *rest = argv
    if mode == "trainer":
        result = train_with_trainer(rest[0])
    else:
        raise SystemExit(f"stack_worker: unknown mode {mode!r}; valid: trainer")
    torch.save(result, out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
