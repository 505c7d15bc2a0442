"""Where the GPU memory of a bench_e2e training step goes, accounted on the CPU at the real shape.

One training step (forward with labels, backward) of a bench_e2e model, built as its peer builds it, runs
under torch's FakeTensorMode on the CPU: every tensor has its real shape and dtype and no data, so the
Qwen3-30B-A3B cut (4.36 B parameters, 16384 tokens) takes seconds and no memory. A TorchDispatchMode
counts the bytes of every live tensor storage after each op, remembers the high-water mark and what was
alive there, and labels each allocation with the module whose forward or backward made it. The weights
are not counted (they exist before the step), nor AdamW's two moments (torch.optim.AdamW keeps them in
the parameters' dtype: 2 × the weights' bytes); the step's peak is

    weights + AdamW moments + the high-water mark printed here

which is what bench_e2e's peak_gib measures (torch.cuda.max_memory_allocated over the timed steps, the
optimizer state present), less allocator rounding and cuBLAS' workspace.

What does not run: Triton kernels (fused_kernels' launches and every Triton kernel call are stubbed;
their output buffers are allocated before the launch, so they count), and the insides of custom ops,
whose fake implementations give their outputs only. The fused MoE experts' two custom ops are the
exception: their Python bodies run here, so the transients inside the experts' forward and backward
count op by op. A read of a value (`.item()`) answers 1 (the loss's range flag, Liger's tile count);
the RMSNorm weights are taken to hold no zeros (bench_e2e's are ones); transformers' mask code is told
it is not tracing, so that, as on the GPU, no 4-D causal mask is built for a batch without padding.
Two things a dispatch mode changes are put back: autograd's engine sums two gradients of one tensor in
place into an operand only it holds (not a view, not kept by a hook), which it never does for tensor
subclasses or under a dispatch mode, so the mode does it for it where the engine would (LiveBytes.
_accumulated); and the modules' backward labels come from gradient hooks on their outputs, not from
full backward hooks, which keep a module's output gradients alive until its backward ends.
SDPA runs the CPU's choice of kernel: for equal head dims that is a fused one that keeps what a GPU's
keeps (output and log-sum-exp), and the Qwen3-MoE step's accounting comes within 0.07 GiB of the
measured peaks of all three peers (docs/kernels/moe_experts.md); where the CPU takes the math path
(DeepSeek-V3's MLA: q/k and v head dims differ) the attention probabilities are made and kept, far
above the GPU, and the output says so.

    python benchmarks/moe_memory.py                       # ours, liger and hf_eager on the Qwen3-MoE cut
    python benchmarks/moe_memory.py --peers ours --trace model.layers.0.mlp.experts
    python benchmarks/moe_memory.py --peers ours,liger --json /tmp/moe_memory.json

Each peer runs in a fresh interpreter (Liger's and our patches are process-wide).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import subprocess
import sys

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: our ops accept the CPU tensors

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for path in (ROOT, HERE):
    if path not in sys.path:
        sys.path.insert(1, path)

import torch  # noqa: E402
from torch._prims_common import is_non_overlapping_and_dense_or_false  # noqa: E402
from torch.multiprocessing.reductions import StorageWeakRef  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_flatten  # noqa: E402

GiB = float(2**30)
MiB = float(2**20)


class LiveBytes(TorchDispatchMode):
    """Bytes of the tensor storages alive after each op, their high-water mark and what was alive there.

    A storage counts from the op that returned it until its last reference goes; storages in `ignore`
    (the weights) never count. `label` names where the step is (set by module hooks); each storage keeps
    the label it was made under. `trace(prefix)` records (label, op, shape, MiB, live MiB after) for every
    allocation made under a label starting with prefix. With `where_min` bytes set, every allocation of at
    least that size also keeps where it was made (`where[serial]`: the op and the innermost Python frames
    of the repository, transformers, peft and torch's checkpoint/autograd code on the stack)."""

    def __init__(self, ignore=(), ops=None, where_min=None):
        super().__init__()
        self.where_min = where_min
        self.where: dict[int, str] = {}  # serial -> "op <- frame <- frame ..." (allocations >= where_min)
        self.freed: dict[int, str] = {}  # serial -> the label (and next op) when it was found freed
        self._op = None  # the op being dispatched
        self.ignore = set(ignore)
        self.ops = ops or {}  # op overload -> Python function run in its place (under this mode)
        self.live: dict[int, tuple] = {}  # storage key -> (bytes, shape, dtype, label, serial)
        self._serial = 0
        self._refs: list[tuple[int, StorageWeakRef]] = []
        self.now = 0
        self.peak = 0
        self.peak_label = ""
        self.at_peak: dict[int, tuple] = {}
        self.label = "start"
        self.trace_prefix = None
        self.trace: list[tuple] = []
        self.square = 0  # ... × n × n softmax outputs: attention probabilities, which a GPU's fused SDPA never makes
        self.label_peak: dict[str, int] = {}  # label -> the most bytes alive after an allocation made under it
        self._probe: list | None = None
        self._exclusive = self._calibrate()

    def _calibrate(self):
        """The owner counts (_owner_pair) that each operand of autograd's accumulation of two gradients shows
        here when the engine holds the last reference to it: a probe backward whose one accumulation adds
        two matmul outputs that nothing else holds. None where the probe finds no such add."""
        self._probe = []
        with self:
            x = torch.ones(4, 4, requires_grad=True)
            w = torch.ones(4, 4)
            h = x * 2
            ((h @ w) + (h @ w.t())).sum().backward()
        seen, self._probe = self._probe, None
        self.live.clear()
        self._refs.clear()
        self.now = self.peak = self._serial = 0
        self.at_peak = {}
        self.label_peak.clear()
        return seen[0] if len(seen) == 1 else None

    def _accumulated(self, args, owners):
        """Autograd's engine sums two gradients of one tensor (InputBuffer::accumulate) in place into an
        operand it holds the last reference to, first the one it had, then the new one; it does so only
        for tensors that are not tensor subclasses and while no dispatch mode is on, so under this mode
        (and fake tensors) it always allocates the sum. Here the sum goes where the engine would put it
        without them: the operand found held by the engine alone, as the probe's were (its owner counts);
        None where the engine would allocate (both held elsewhere too: a hook, a saved tensor, a view's
        base). An add of two whole tensors inside a C++ node's formula that met the same counts would be
        taken in place too: one temporary fewer counted there."""
        a, b = args
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                and a.dtype == b.dtype and a.device == b.device):
            return None
        for i, (own, other) in enumerate(((a, b), (b, a))):
            if owners[i] == self._exclusive[i] and is_non_overlapping_and_dense_or_false(own):
                own.add_(other)
                return own
        return None

    def _sweep(self) -> None:
        kept = []
        for key, ref in self._refs:
            if ref.expired():
                entry = self.live.pop(key)
                self.now -= entry[0]
                if entry[4] in self.where:
                    self.freed[entry[4]] = f"{self.label}, before {_op_name(self._op)}"
            else:
                kept.append((key, ref))
        self._refs = kept

    def _add(self, t: torch.Tensor, op) -> None:
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self.live or key in self.ignore:
            return
        n = storage.nbytes()
        self._serial += 1  # a freed storage's key can come back: serials tell allocations apart
        self.live[key] = (n, tuple(t.shape), str(t.dtype).replace("torch.", ""), self.label, self._serial)
        if self.where_min is not None and n >= self.where_min:
            self.where[self._serial] = f"{_op_name(op)} <- {_frames()}"
        self._refs.append((key, StorageWeakRef(storage)))
        self.now += n
        if self.trace_prefix is not None and self.label.split(" ", 1)[-1].startswith(self.trace_prefix):
            self.trace.append((self.label, str(op), tuple(t.shape), n / MiB, self.now / MiB))
        if self.now > self.label_peak.get(self.label, 0):
            self.label_peak[self.label] = self.now
        if self.now > self.peak:
            self.peak, self.peak_label, self.at_peak = self.now, self.label, dict(self.live)

    def serial(self, t: torch.Tensor):
        """The serial of t's storage while it is alive (None if it is not counted)."""
        entry = self.live.get(t.untyped_storage()._cdata)
        return entry[4] if entry else None

    def settle(self) -> int:
        """Bytes alive now, after dropping what was freed since the last op."""
        self._sweep()
        return self.now

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default:
            return 1  # a value read on the host: the data are fake
        if func is torch.ops.aten.equal.default:
            return True  # Liger's loss backward asks whether the upstream gradient is 1: it is
        if func in self.ops:
            with self:  # its ops are counted one by one
                return self.ops[func](*args, **kwargs)
        if func is torch.ops.aten.add.Tensor and len(args) == 2 and not kwargs and _called_by_engine():
            owners = _owner_pair(*args)  # first: the probe's and the step's counts taken at the same point
            if self._probe is not None:
                self._probe.append(owners)
            elif self._exclusive is not None:
                summed = self._accumulated(args, owners)
                if summed is not None:
                    return summed
        self._op = func
        out = func(*args, **kwargs)
        if (func in (torch.ops.aten._softmax.default, torch.ops.aten._safe_softmax.default) and out.dim() >= 3
                and out.shape[-1] == out.shape[-2] > 1):
            self.square += out.untyped_storage().nbytes()
        self._sweep()
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._add(t, func)
        return out


_DISPATCH_FILES = ("torch/_dynamo/eval_frame.py", "torch/_compile.py", "torch/utils/_python_dispatch.py")


def _called_by_engine() -> bool:
    """Whether the op being dispatched was called from autograd's C++ engine (its gradient sums, or a C++
    node's formula: no Python frame between the backward's entry and this dispatch), not from a Python
    backward."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.endswith(_DISPATCH_FILES):
        frame = frame.f_back
    return frame is not None and frame.f_code.co_name == "_engine_run_backward"


def _owner_pair(a: torch.Tensor, b: torch.Tensor) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """Per operand: (C++ references to its TensorImpl, Python references to its wrapper, references to its
    storage), as seen from LiveBytes' dispatch through this one call path, the probe's and the step's
    alike (so that the counts compare)."""
    return tuple((t._use_count(), sys.getrefcount(t), torch._C._storage_Use_Count(t.untyped_storage()._cdata))
                 for t in (a, b))


_WHERE_PARTS = ("/autopatch/", "/fused_kernels/", "/transformers/", "/peft/", "torch/utils/checkpoint.py",
                "torch/autograd/function.py", "torch/autograd/graph.py", "/benchmarks/")


def _op_name(op) -> str:
    name = str(op)
    return name[len("aten."):] if name.startswith("aten.") else name


def _frames(keep: int = 5) -> str:
    """The innermost `keep` frames of the stack in the code that makes a step's tensors (the repository,
    transformers, peft, torch's checkpoint and autograd.Function), as file:line function, this file's and
    the dispatch machinery's left out."""
    out = []
    frame = sys._getframe(2)
    while frame is not None and len(out) < keep:
        path = frame.f_code.co_filename
        if path != __file__ and frame.f_code.co_name != "_add" and any(part in path for part in _WHERE_PARTS):
            tail = "/".join(path.split("/")[-2:])
            out.append(f"{tail}:{frame.f_lineno} {frame.f_code.co_name}")
        frame = frame.f_back
    return " <- ".join(out) or "(C++: autograd engine)"


@contextlib.contextmanager
def stand_ins():
    """Triton kernels do nothing (fused_kernels' launch helper, and any kernel[grid](...) call, Liger's
    autotuned ones included); RMSNorm's weights are taken to hold no zeros; transformers' masks do not
    take fake tensors for a trace (it would build the 4-D causal mask that a GPU run, with no padding,
    leaves to SDPA's is_causal, and repeat K and V for it). Restored on exit."""
    import triton.runtime.autotuner as autotuner
    import triton.runtime.interpreter as interpreter
    import triton.runtime.jit as jit
    from transformers import masking_utils

    import fused_kernels  # noqa: F401 - every op module, so that each one's `launch` name is replaced
    from fused_kernels.ops import rms_norm

    def nothing(*args, **kwargs):
        return None

    swaps = [(m, "launch") for name, m in list(sys.modules.items())
             if name.startswith("fused_kernels") and callable(getattr(m, "launch", None))]
    swaps += [(jit.JITFunction, "run"), (interpreter.InterpretedFunction, "run"), (autotuner.Autotuner, "run"),
              (autotuner.Heuristics, "run")]
    saved = [(obj, attr, getattr(obj, attr)) for obj, attr in swaps]
    for obj, attr in swaps:
        setattr(obj, attr, nothing)
    saved.append((rms_norm, "_weight_without_zeros", rms_norm._weight_without_zeros))
    rms_norm._weight_without_zeros = lambda *args: True
    saved.append((masking_utils, "is_tracing", masking_utils.is_tracing))
    masking_utils.is_tracing = lambda *args: False
    try:
        yield
    finally:
        for obj, attr, value in saved:
            setattr(obj, attr, value)


def experts_ops() -> dict:
    """The fused experts' custom ops mapped to their Python bodies, so that their transients count."""
    from fused_kernels.ops import moe_experts

    return {torch.ops.fused_kernels.moe_experts_fwd.default: moe_experts._forward,
            torch.ops.fused_kernels.moe_experts_bwd.default:
                lambda *args: moe_experts._backward(*args, gu_scratch=False),
            torch.ops.fused_kernels.moe_experts_bwd_into_gu.default:
                lambda *args: moe_experts._backward(*args, gu_scratch=True)}


def build(model_key: str, peer: str):
    """(model on the meta device as `peer` trains it, spec, its parameter bytes)."""
    import bench_e2e
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = bench_e2e.MODELS[model_key]
    if spec.get("kind") == "image_text":
        raise SystemExit(f"{model_key}: image-text models are not accounted here")
    if peer == "liger":
        bench_e2e._apply_liger(spec)
    cfg = AutoConfig.for_model(spec["model_type"], **spec["config"])
    cfg.use_cache = False
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa")
    if peer == "ours":
        import autopatch

        autopatch.apply(model, **bench_e2e.OUR_TOGGLES)
    elif peer != "liger" and peer != "hf_eager":
        raise SystemExit(f"peer {peer!r}: one of ours, liger, hf_eager")
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    return model.train(), spec, weights


def _hook_labels(model, tracker: LiveBytes, depth: int) -> None:
    """Forward pre-hooks that set tracker.label to "fwd NAME", and on each module's outputs gradient hooks
    that set it to "bwd NAME" when the gradient of that output is ready (the module's backward starts).
    Not a module's full backward hooks: those keep the gradients of its outputs alive until the module's
    backward ends (BackwardHook.grad_outputs), a tensor a step without them frees earlier. Not on
    lm_head: a hooked lm_head is not the plain Linear a fused loss takes."""

    def at(label):
        def hook(*_args, **_kwargs):
            tracker.label = label
        return hook

    def on_outputs(label):
        set_label = at(label)

        def hook(_module, _args, output):
            if not torch.is_grad_enabled():
                return None
            for t in tree_flatten(output)[0]:
                if isinstance(t, torch.Tensor) and t.grad_fn is not None:
                    t.register_hook(set_label)  # returns None: the gradient is neither kept nor changed
            return None
        return hook

    for name, module in model.named_modules():
        if name and name != "lm_head" and name.count(".") < depth:
            module.register_forward_pre_hook(at(f"fwd {name}"))
            module.register_forward_hook(on_outputs(f"bwd {name}"))


def _layer(label: str) -> str:
    """"model.layers.3.mlp.experts" -> "layer 3"; other modules by their name."""
    name = label.split(" ", 1)[-1]
    parts = name.split(".")
    if "layers" in parts and parts.index("layers") + 1 < len(parts):
        return f"layer {parts[parts.index('layers') + 1]}"
    return name


def account(model_key: str, peer: str, trace: str | None = None, depth: int = 5) -> dict:
    """One fake training step of (model_key, peer): the high-water mark beyond the weights, what was
    alive there by kind, the level after the forward, and the step's peak with AdamW's moments."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    model, spec, weights = build(model_key, peer)
    with stand_ins(), FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device="cpu")
        tracker = LiveBytes(ignore={t.untyped_storage()._cdata for t in (*model.parameters(), *model.buffers())},
                            ops=experts_ops() if peer == "ours" else None)
        tracker.trace_prefix = trace
        _hook_labels(model, tracker, depth)
        grads = set()  # serials of the storages that became parameter gradients
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(lambda p: grads.add(tracker.serial(p.grad)))
        vocab = spec["config"]["vocab_size"]
        ids = torch.randint(0, vocab, (spec["batch"], spec["seq"]))
        with tracker:
            loss = model(input_ids=ids, labels=ids).loss
            after_forward = tracker.settle()
            kept = collections.defaultdict(float)  # what the forward left for the backward, by module
            for n, _shape, _dtype, label, _serial in tracker.live.values():
                kept[label.split(" ", 1)[-1]] += n
            forward_peak = tracker.peak
            tracker.label = "bwd loss"
            loss.backward()
            after_backward = tracker.settle()
    kinds: dict[str, float] = collections.defaultdict(float)
    by_layer: dict[str, float] = collections.defaultdict(float)
    largest = collections.defaultdict(lambda: [0, 0])
    for n, shape, dtype, label, serial in tracker.at_peak.values():
        kind = ("gradients" if serial in grads else
                "saved by the forward" if label.startswith("fwd") or label == "start" else "backward transients")
        kinds[kind] += n
        by_layer[f"{kind}: {_layer(label)}"] += n
        if kind != "gradients":
            entry = largest[(kind, label, shape, dtype)]
            entry[0] += n
            entry[1] += 1
    adam = 2 * weights  # torch.optim.AdamW: exp_avg and exp_avg_sq in the parameters' dtype
    return {
        "model": model_key, "peer": peer, "tokens": spec["batch"] * spec["seq"],
        "weights_gib": weights / GiB, "adamw_moments_gib": adam / GiB,
        "peak_beyond_weights_gib": tracker.peak / GiB, "peak_at": tracker.peak_label,
        "step_peak_gib": (weights + adam + tracker.peak) / GiB,
        "attention_probabilities_gib": tracker.square / GiB,
        "forward_peak_beyond_weights_gib": forward_peak / GiB,
        "after_forward_gib": after_forward / GiB, "after_backward_gib": after_backward / GiB,
        "after_forward_by_module_mib": {k: round(v / MiB, 1) for k, v in sorted(kept.items())},
        "at_peak_gib": {k: v / GiB for k, v in sorted(kinds.items())},
        "at_peak_by_layer_mib": {k: round(v / MiB, 1) for k, v in sorted(by_layer.items())},
        "at_peak_largest": [{"kind": k, "made_in": lab, "shape": list(sh), "dtype": dt, "count": c,
                             "mib": round(n / MiB, 1)}
                            for (k, lab, sh, dt), (n, c) in sorted(largest.items(), key=lambda kv: -kv[1][0])[:16]],
        "trace": [{"at": lab, "op": op, "shape": list(sh), "mib": round(mb, 1), "live_mib": round(live, 1)}
                  for lab, op, sh, mb, live in tracker.trace],
    }


def show(res: dict) -> None:
    print(f"\n== {res['model']} / {res['peer']}  ({res['tokens']} tokens)")
    print(f"weights {res['weights_gib']:.2f} GiB + AdamW moments {res['adamw_moments_gib']:.2f} GiB "
          f"+ high-water mark {res['peak_beyond_weights_gib']:.3f} GiB (in {res['peak_at']}) "
          f"= step peak {res['step_peak_gib']:.2f} GiB")
    if res["attention_probabilities_gib"]:
        print(f"NOTE: {res['attention_probabilities_gib']:.2f} GiB of attention probabilities were made (the CPU's SDPA "
              "took its math path, e.g. for q/k and v head dims that differ); a GPU's fused attention makes none, "
              "so this accounting is above what the GPU allocates")
    print(f"forward: high-water mark {res['forward_peak_beyond_weights_gib']:.3f} GiB, "
          f"{res['after_forward_gib']:.3f} GiB alive after it; after the backward {res['after_backward_gib']:.3f} GiB")
    layer0 = {k: v for k, v in res["after_forward_by_module_mib"].items() if k.startswith("model.layers.0")}
    print(f"kept by the forward for layer 0 ({sum(layer0.values()):.1f} MiB; each layer alike): "
          + ", ".join(f"{k.replace('model.layers.0.', '')} {v:.1f}" for k, v in layer0.items()))
    rest = {k: v for k, v in res["after_forward_by_module_mib"].items() if ".layers." not in k}
    print("kept outside the layers (MiB): " + ", ".join(f"{k} {v:.1f}" for k, v in rest.items()))
    print("alive at the peak: " + ", ".join(f"{k} {v:.3f} GiB" for k, v in res["at_peak_gib"].items()))
    for k, v in res["at_peak_by_layer_mib"].items():
        print(f"    {v:9.1f} MiB  {k}")
    print("largest non-gradient tensors alive at the peak:")
    for e in res["at_peak_largest"]:
        print(f"    {e['mib']:9.1f} MiB  x{e['count']} {e['kind']:20s} {e['made_in']:45s} {e['shape']} {e['dtype']}")
    if res["trace"]:
        print("allocations traced (MiB, live MiB after):")
        for e in res["trace"]:
            print(f"    {e['at']:40s} {e['op']:40s} {str(e['shape']):22s} {e['mib']:8.1f} {e['live_mib']:10.1f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3_moe_30b_a3b_6layers")
    ap.add_argument("--peers", default="ours,liger,hf_eager", help="comma list: ours, liger, hf_eager")
    ap.add_argument("--trace", help="list every allocation made under modules whose name starts with this")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--worker", action="store_true", help="internal: account one peer, print its JSON")
    a = ap.parse_args(argv)
    peers = [p for p in a.peers.split(",") if p]
    if a.worker:
        print("RESULT " + json.dumps(account(a.model, peers[0], a.trace)))
        return 0
    results = []
    for peer in peers:
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--model", a.model, "--peers", peer]
        if a.trace:
            cmd += ["--trace", a.trace]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode or not lines:
            print(f"\n== {a.model} / {peer}: failed (exit {proc.returncode})\n{proc.stderr[-3000:]}")
            continue
        res = json.loads(lines[-1][len("RESULT "):])
        results.append(res)
        show(res)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0 if len(results) == len(peers) else 1


if __name__ == "__main__":
    sys.exit(main())
