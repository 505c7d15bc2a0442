"""What was patched, what was left alone and why. Every rule reports here; `autopatch.applied()`,
`AUTOPATCH_REPORT=path.json` and `python -m autopatch doctor` read it."""

from __future__ import annotations

import dataclasses
import threading


@dataclasses.dataclass(frozen=True)
class Record:
    kernel: str  # kernel name, e.g. "rms_norm"
    module: str  # e.g. "transformers.models.llama.modeling_llama"
    target: str  # e.g. "LlamaRMSNorm" or "apply_rotary_pos_emb" or "LlamaForCausalLM.forward"
    patched: bool
    variant: str = ""  # detected variant when patched, e.g. "offset=1 casting=gemma"
    reason: str = ""  # why it was left alone, when not patched

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


_records: list[Record] = []
_lock = threading.Lock()


def add(records) -> None:
    with _lock:
        _records.extend(records)


def records() -> list[Record]:
    with _lock:
        return list(_records)


def clear() -> None:
    with _lock:
        _records.clear()


_fallback_noticed: set[str] = set()


def fallback_notice(kernel: str, detail: str) -> None:
    """A patched component met tensors Triton cannot run on and called the original code. Say so
    once per process and kernel (stderr), so a CPU run without the interpreter is not a surprise."""
    import sys

    with _lock:
        if kernel in _fallback_noticed:
            return
        _fallback_noticed.add(kernel)
    print(
        f"autopatch: {kernel}: {detail}; running the original code instead "
        "(Triton runs on CUDA tensors, or on the CPU with TRITON_INTERPRET=1)",
        file=sys.stderr,
    )
