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
