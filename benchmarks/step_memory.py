"""What a bench_long_context training step keeps per decoder layer, accounted on the CPU at the real width.

A model of bench_long_context.MODELS is built as its trial builds it (gradient checkpointing, non-reentrant;
host offload installed before peft's LoRA; our kernels from the environment's FUSED_KERNELS), cut to K and
K + 1 layers, and one step (forward with labels, backward) runs under FakeTensorMode with
moe_memory.LiveBytes counting the live tensor bytes op by op (Triton kernels stubbed, moe_memory.stand_ins).
Host offload is played by a target whose host copies are not counted: what the offloader's pack sends to
the host leaves the count, what its unpack brings back enters it again. The difference between the two
depths is what one more layer costs at that length, beyond its weights:

    python benchmarks/step_memory.py --model llama3.1_8b_lora --seq 16384
    FUSED_KERNELS=all AUTOPATCH_OFFLOAD=true AUTOPATCH_TILED_MLP_TOKENS=8192 \
        python benchmarks/step_memory.py --model llama3.1_8b_lora --seq 16384 --layers 2

Each depth runs in a fresh interpreter (our patches are process-wide).

The offloader's prefetch asks the target for the GPU's room: here `--device-gib` (79.2, an H100's) less
the full-depth model's weights less what is counted now. `--where MIB` names, for each tensor of at least
MIB alive at the high-water mark, the op and the Python frames that made it and where in the step it was
found freed (its holder let go there: a saved tensor at its node's backward, the recompute's inputs at
the recompute's end); the highest level under each label shows the other moments near the mark:

    FUSED_KERNELS=all AUTOPATCH_OFFLOAD=true AUTOPATCH_TILED_MLP_TOKENS=8192 \
        python benchmarks/step_memory.py --model llama3.1_8b_lora --seq 65536 --layers 3 --where 256
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys

# first: moe_memory sets TRITON_INTERPRET=1 before triton is imported and puts the repository on sys.path
from moe_memory import GiB, MiB, LiveBytes, _hook_labels, stand_ins  # isort: skip

import torch  # noqa: E402
from torch.multiprocessing.reductions import StorageWeakRef  # noqa: E402


class HostLiveBytes(LiveBytes):
    """LiveBytes that leaves out the storages in `hosted` while they live (host copies)."""

    def __init__(self, *args, **kwargs):
        self.hosted: dict[int, object] = {}  # storage key -> its weak reference (before LiveBytes' probe runs)
        super().__init__(*args, **kwargs)

    def host(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = storage._cdata
        self.settle()
        entry = self.live.pop(key, None)
        if entry is not None:
            self.now -= entry[0]
            self._refs = [(k, ref) for k, ref in self._refs if k != key]
        self.hosted[key] = StorageWeakRef(storage)

    def _add(self, t: torch.Tensor, op) -> None:
        key = t.untyped_storage()._cdata
        ref = self.hosted.get(key)
        if ref is not None:
            if not ref.expired():
                return
            del self.hosted[key]  # a host copy freed: its address now holds a new storage
        super()._add(t, op)


class HostTarget:
    """The offloader's target in a fake step: a host copy leaves the tracker's count while it lives
    (pinned host memory on a GPU), a copy back is counted as any allocation. The GPU's room (what the
    offloader's prefetch asks) is `device_bytes` less the full-depth model's weights less what the
    tracker counts now, less the offloader's margin, as CudaTarget.room reads it on the GPU."""

    name = "fake-host"

    def __init__(self, tracker: "HostLiveBytes", device_bytes: int = 0, weights: int = 0):
        self.tracker = tracker
        self.device = torch.device("cpu")
        self.device_bytes, self.weights = device_bytes, weights

    def room(self) -> int:
        from autopatch import offload

        free = self.device_bytes - self.weights - self.tracker.settle()
        return free - offload._margin(self.device_bytes, offload.GPU_MARGIN)

    def holds(self, t) -> bool:
        return t.device.type == "cpu"

    def to_host(self, t):
        host = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device="cpu")
        self.tracker.host(host)
        return host, None

    def to_device(self, host, after):
        return torch.empty_strided(host.size(), host.stride(), dtype=host.dtype, device="cpu"), None

    def ready(self, dev, done) -> None:
        pass

    def budget(self, model, session, working: int = 0) -> int:
        return 0

    def pinned(self, nbytes: int) -> int:
        from autopatch import offload

        return offload.host_copy_bytes(nbytes)

    def cached(self) -> int:
        return 0

    def dropped(self, host) -> None:
        pass

    def forward_done(self) -> None:
        pass


def _fake_candidate(offloader):
    """The offloader's own test, with fake tensors taken as the plain tensors they stand for."""
    from torch._subclasses.fake_tensor import FakeTensor

    def candidate(t) -> bool:
        if type(t) is FakeTensor:
            if t.layout != torch.strided or t.numel() * t.element_size() < offloader.min_bytes:
                return False
            if t.is_leaf and t.requires_grad:
                return False
            base = t._base
            return not (base is not None and (isinstance(base, torch.nn.Parameter)
                                              or (base.is_leaf and base.requires_grad)))
        return type(offloader).candidate(offloader, t)

    return candidate


def build(model_key: str, layers: int):
    """The model on the meta device as bench_long_context.build() makes it for the ours* peers."""
    import bench_long_context as blc

    if os.environ.get("FUSED_KERNELS"):
        import autopatch

        autopatch.enable()
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = blc.MODELS[model_key]
    config = dict(spec["config"], num_hidden_layers=layers)
    cfg = AutoConfig.for_model("llama", **config)
    cfg.use_cache = False
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    offloader = None
    from autopatch import offload, session

    if offload.mode_of(session.current().settings) != "false":
        offloader = offload.install(model, session.current(), session.current().settings, target="copy")
    if spec["lora_r"]:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=spec["lora_r"], lora_alpha=2 * spec["lora_r"],
                                                 target_modules="all-linear", lora_dropout=0.0))
    return model.train(), offloader


def full_depth_weights(model, model_key: str, layers: int) -> int:
    """The parameter bytes of the model at its full depth: the cut's, and one decoder layer's (its
    adapters included) for each layer left out."""
    import bench_long_context as blc

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    per_layer = sum(p.numel() * p.element_size() for p in base.model.layers[0].parameters())
    cut = sum(p.numel() * p.element_size() for p in model.parameters())
    return cut + (blc.MODELS[model_key]["config"]["num_hidden_layers"] - layers) * per_layer


def account(model_key: str, layers: int, seq: int, where_mib: float = 0, device_gib: float = 79.2) -> dict:
    from torch._subclasses.fake_tensor import FakeTensorMode

    model, offloader = build(model_key, layers)
    trained = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    weights = full_depth_weights(model, model_key, layers)
    with stand_ins(), FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device="cpu")
        tracker = HostLiveBytes(ignore={t.untyped_storage()._cdata for t in (*model.parameters(), *model.buffers())},
                                where_min=int(where_mib * MiB) if where_mib else None)
        if offloader is not None:
            offloader.target = HostTarget(tracker, int(device_gib * GiB), weights)
            offloader.candidate = _fake_candidate(offloader)
            offloader.checked = True  # the host check reads the real host: not this step's question
        _hook_labels(model.get_base_model() if hasattr(model, "get_base_model") else model, tracker, 5)
        grads = set()
        for p in model.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(lambda p: grads.add(tracker.serial(p.grad)))
        ids = torch.randint(0, model.config.vocab_size, (1, seq))
        with tracker:
            loss = model(input_ids=ids, labels=ids).loss
            after_forward = tracker.settle()
            kept = collections.defaultdict(lambda: [0, 0])
            for n, shape, dtype, label, _serial in tracker.live.values():
                entry = kept[(label.split(" ", 1)[-1], shape, dtype)]
                entry[0] += n
                entry[1] += 1
            forward_peak = tracker.peak
            tracker.label = "bwd loss"
            loss.backward()
            after_backward = tracker.settle()
    return {"model": model_key, "layers": layers, "seq": seq, "trained_gib": trained / GiB,
            "peak_beyond_weights_gib": tracker.peak / GiB, "peak_at": tracker.peak_label,
            "forward_peak_gib": forward_peak / GiB, "after_forward_gib": after_forward / GiB,
            "after_backward_gib": after_backward / GiB,
            "at_peak": sorted(([lab, list(sh), dt, round(n / MiB, 1), serial in grads, tracker.where.get(serial, ""),
                                tracker.freed.get(serial, "alive at the end")]
                               for n, sh, dt, lab, serial in tracker.at_peak.values() if n >= MiB), key=lambda e: -e[3]),
            "offload": dict(offloader.stats) if offloader is not None else None,
            "highest_by_label": sorted(([lab, round(n / GiB, 3)] for lab, n in tracker.label_peak.items()),
                                       key=lambda e: -e[1]),
            "after_forward": sorted(([lab, list(sh), dt, c, round(n / MiB, 1)]
                                     for (lab, sh, dt), (n, c) in kept.items()), key=lambda e: -e[4])}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama3.1_8b_lora")
    ap.add_argument("--seq", type=int, default=16384)
    ap.add_argument("--layers", type=int, default=2, help="K: the step is accounted at K and K + 1 layers")
    ap.add_argument("--where", type=float, default=0, metavar="MIB",
                    help="for tensors of at least MIB alive at the high-water mark: the op and the Python frames "
                         "that made each, and where in the step it was freed")
    ap.add_argument("--device-gib", type=float, default=79.2,
                    help="the GPU's memory, for the offloader's prefetch decisions (H100: 79.2)")
    ap.add_argument("--worker", action="store_true", help="internal: one depth, its JSON printed")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    if os.environ.get("AUTOPATCH_ATTENTION_QUERY_BLOCK_TOKENS", "0") not in ("", "0"):
        ap.error("AUTOPATCH_ATTENTION_QUERY_BLOCK_TOKENS: the query blocks' lower-right causal mask (CausalBias) "
                 "cannot be built under fake tensors, and what they save, flash-attention's backward workspace, "
                 "is no tensor a fake step sees: measure them on a GPU (bench_long_context.py, peer "
                 "ours_offload_tiled_qblocks); unset the variable here")
    if a.worker:
        print("RESULT " + json.dumps(account(a.model, a.layers, a.seq, a.where, a.device_gib)))
        return 0
    results = []
    for depth in (a.layers, a.layers + 1):
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--model", a.model, "--seq", str(a.seq),
               "--layers", str(depth), "--where", str(a.where), "--device-gib", str(a.device_gib)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode or not lines:
            print(f"{a.model} at {depth} layers: failed (exit {proc.returncode})\n{proc.stderr[-3000:]}")
            return 1
        results.append(json.loads(lines[-1][len("RESULT "):]))
    for res in results:
        print(f"\n== {res['model']}, {res['layers']} layers, {res['seq']} tokens: high-water mark beyond the weights "
              f"{res['peak_beyond_weights_gib']:.3f} GiB (in {res['peak_at']}); forward's {res['forward_peak_gib']:.3f}, "
              f"after the forward {res['after_forward_gib']:.3f}, after the backward {res['after_backward_gib']:.3f}; "
              f"offload {res['offload']}")
        print("alive after the forward (MiB):")
        for label, shape, dtype, count, mib in res["after_forward"][:24]:
            print(f"    {mib:9.1f}  x{count} {label:50s} {shape} {dtype}")
        print("the highest level under each label (GiB): " + ", ".join(f"{lab} {gib:.3f}"
                                                                      for lab, gib in res["highest_by_label"][:8]))
        print("alive at the high-water mark (MiB; True: a parameter's gradient):")
        for label, shape, dtype, mib, grad, where, freed in res["at_peak"][:30]:
            print(f"    {mib:9.1f}  {label:50s} {shape} {dtype} {grad}")
            if where:
                print(f"                 made by {where}\n                 freed in {freed}")
    lo, hi = results
    print(f"\nper layer at {a.seq} tokens: high-water mark +{(hi['peak_beyond_weights_gib'] - lo['peak_beyond_weights_gib']) * 1024:.1f} MiB, "
          f"after the forward +{(hi['after_forward_gib'] - lo['after_forward_gib']) * 1024:.1f} MiB, "
          f"trained parameters +{(hi['trained_gib'] - lo['trained_gib']) * 1024:.1f} MiB")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
