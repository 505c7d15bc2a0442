"""Host offload of what a training forward saves for the backward (AUTOPATCH_OFFLOAD=auto|true).

While a model's training forward runs (its module in training mode, autograd recording), every tensor
autograd saves for the backward goes through torch.autograd.graph.saved_tensors_hooks:

  pack    a tensor of at least MIN_BYTES that is not a parameter (nor a view of one) and lives on the
          model's GPU is copied to pinned host memory on a side CUDA stream, after the compute that
          made it; its GPU memory is released once that copy is done (record_stream). What stays is a
          handle. The same tensor saved by several nodes (the normed input of q, k and v) is copied once.
          Copies of at least EXACT_MIN_BYTES (layer inputs at long context) go to exact-size buffers
          reused from step to step (autopatch.host_buffers), not to PyTorch's pinned allocator, which
          rounds each to a power of two.
  unpack  in the backward, the first use of a layer's tensors brings that layer's back (if they are
          not already) and starts bringing back the previous layer's, on the side stream: the copies
          of layer i - 1 overlap the backward of layer i. The compute stream waits for the copy's
          event before it reads the tensor. Once every node that saved a tensor has had it, the
          store lets go of the device copy: it lives as long as those nodes hold it (a checkpointed
          layer's input: until its recompute is done), not until the layer's backward ends.
  prefetch  layer i - 1 comes back early only where the GPU has room for it beside layer i's backward:
          its free memory (the driver's and the caching allocator's) less a margin (GPU_MARGIN) less
          one layer's backward working set (working_bytes) must hold it; else it comes back when its
          own backward asks for it (at long lengths, where a layer's backward takes far longer than
          the copy, the overlap is worth little and the room is worth a whole layer input).

Layers are the children of the model's longest nn.ModuleList (its decoder layers); a forward
pre-hook on each tells the store which layer's tensors are being saved.

With HF's gradient checkpointing (non-reentrant, transformers' default), the tensors saved outside
the recompute are each checkpointed layer's inputs (torch.utils.checkpoint keeps them as saved
tensors): those go to the host, the layer's own activations are recomputed as usual. Reentrant
checkpointing saves its inputs with save_for_backward: the same. Without checkpointing every saved
activation of 1 MiB or more is a candidate.

Placement. `true`: every candidate goes to the host. `auto`: what fits stays on the GPU — a budget,
taken at each training forward, of the GPU's memory less what is allocated, less the gradients not
yet allocated and (before the optimizer's first step) AdamW's two moments per trained parameter,
less one layer's backward working set (its activations and their gradients, from the config and the
tokens), less a margin (max(2 GiB, 10 % of the GPU)); the first tensors saved stay until the budget
is spent, the rest go to the host. Either way the host is never asked for more than its
MemAvailable less a margin (max(4 GiB, 10 %)): past that, tensors stay on the GPU. Before the
first training forward, when the host cannot hold what this step would offload (estimated from the
model's config and the input's tokens), one line says how much is needed and what to change, and
offload stays off.

On the CPU (no CUDA) there is nothing to offload to; `target="copy"` (tests) runs the same pack and
unpack path with a copy into a separate CPU tensor in place of the pinned host buffer, so the CPU tests
prove the mechanism (loss and every gradient equal) without a GPU.

install(model, session, settings) is what start-up calls for each model built under the setting.
"""

from __future__ import annotations

import os
import threading
import weakref

import torch
from torch import nn

from autopatch.host_buffers import HostBuffers, exact_bytes
from autopatch.session import say

MIN_BYTES = 1 << 20  # smaller saved tensors stay where they are: not worth a copy
EXACT_MIN_BYTES = 16 << 20  # host copies this large go to exact-size buffers (host_buffers)
GPU_MARGIN = (2 << 30, 0.10)  # (at least, fraction of the GPU) left free in "auto"
HOST_MARGIN = (4 << 30, 0.10)  # (at least, fraction of MemAvailable) never offloaded into
ADAM_MOMENTS = 2  # AdamW's moments per trained parameter (each the parameter's dtype), before its first step
_ACTIVE = threading.local()  # the store of the training forward running on this thread, if any


# --------------------------------------------------------------------------- the host
def host_available() -> int | None:
    """Bytes the host can give without swapping: MemAvailable (psutil, else /proc/meminfo)."""
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except Exception:  # noqa: BLE001 - psutil missing: read the kernel's own figure
        pass
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def host_room(available: int | None = None) -> int | None:
    """Bytes the offloader may still place on the host: MemAvailable less its margin."""
    available = host_available() if available is None else available
    return None if available is None else max(0, available - _margin(available, HOST_MARGIN))


def pinned_bytes(nbytes: int, alloc_conf: str | None = None) -> int:
    """The pinned host bytes PyTorch's caching host allocator reserves for a request of `nbytes`: the
    next power of two (its free lists are power-of-two buckets), unless the allocator's configuration
    (PYTORCH_ALLOC_CONF, or PYTORCH_CUDA_ALLOC_CONF) sets pinned_max_round_threshold_mb or
    pinned_max_cached_size_mb below the request. A 500000-token checkpoint of a 4096-wide bf16 model
    (3.81 GiB) takes 4 GiB; one of 270000 tokens (2.06 GiB) takes 4 GiB."""
    if nbytes <= 0:
        return 0
    if alloc_conf is None:
        alloc_conf = os.environ.get("PYTORCH_ALLOC_CONF") or os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or ""
    for item in alloc_conf.split(","):
        key, _, value = item.partition(":")
        if key.strip() in ("pinned_max_round_threshold_mb", "pinned_max_cached_size_mb"):
            try:
                if nbytes > float(value) * 2**20:
                    return nbytes
            except ValueError:
                pass
    return 1 << (nbytes - 1).bit_length()


def host_copy_bytes(nbytes: int) -> int:
    """The page-locked host bytes a GPU tensor's host copy takes: its own size to a page from
    EXACT_MIN_BYTES on (autopatch.host_buffers), the pinned allocator's block below."""
    return exact_bytes(nbytes) if nbytes >= EXACT_MIN_BYTES else pinned_bytes(nbytes)


def cached_pinned_bytes() -> int:
    """Pinned host bytes PyTorch's caching host allocator holds free for reuse (a previous step's host
    copies: MemAvailable counts them as used); 0 where torch does not say."""
    stats_of = getattr(torch.cuda, "host_memory_stats", None)
    if stats_of is None or not torch.cuda.is_available():
        return 0
    try:
        stats = stats_of()
        owned, active = stats.get("allocated_bytes.current"), stats.get("active_bytes.current")
        if owned is None or active is None:  # another torch's names: count nothing rather than guess
            return 0
        return max(0, int(owned) - int(active))
    except Exception:  # noqa: BLE001 - an older torch's stats: count nothing
        return 0


def _margin(total: int, margin: tuple[int, float]) -> int:
    return max(margin[0], int(total * margin[1]))


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


# --------------------------------------------------------------------------- where tensors go
class _HostCopies:
    """What both targets share: the host tensor a copy goes into (an exact-size buffer from `buffers`
    where `exact` says so, else a tensor of its own) and the buffers' bookkeeping."""

    buffers: HostBuffers
    pin_memory = False  # the host tensors of their own: page-locked (the CUDA target) or not

    def exact(self, nbytes: int) -> bool:
        raise NotImplementedError

    def host_for(self, t: torch.Tensor) -> torch.Tensor:
        stride = torch.empty_like(t, device="meta").stride()  # t's layout when dense, else contiguous
        if self.exact(t.numel() * t.element_size()):
            return self.buffers.host_like(t, stride)
        return torch.empty_strided(t.size(), stride, dtype=t.dtype, device="cpu", pin_memory=self.pin_memory)

    def dropped(self, host: torch.Tensor) -> None:
        """A host copy's handle is gone: its exact-size buffer (if it has one) may be taken again."""
        self.buffers.give(host.data_ptr())

    def forward_done(self) -> None:
        self.buffers.sweep()


class CudaTarget(_HostCopies):
    """Pinned host memory, copies on a side stream of the model's GPU."""

    name = "cuda"
    pin_memory = True

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.buffers = HostBuffers(self.stream)  # the large copies' exact-size buffers

    def holds(self, t: torch.Tensor) -> bool:
        return t.device == self.device

    def exact(self, nbytes: int) -> bool:
        return nbytes >= EXACT_MIN_BYTES

    def to_host(self, t: torch.Tensor):
        host = self.host_for(t)
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)  # t is made on the compute stream
        with torch.cuda.stream(self.stream):
            host.copy_(t, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        t.record_stream(self.stream)  # t's memory is not reused before the copy read it
        return host, done

    def to_device(self, host: torch.Tensor, after):
        current = torch.cuda.current_stream(self.device)
        dev = torch.empty_strided(host.size(), host.stride(), dtype=host.dtype, device=self.device)
        self.stream.wait_stream(current)  # dev's memory may have been freed by compute not yet done
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(after)
            dev.copy_(host, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        return dev, done

    def ready(self, dev: torch.Tensor, done) -> None:
        current = torch.cuda.current_stream(self.device)
        current.wait_event(done)
        dev.record_stream(current)

    def pinned(self, nbytes: int) -> int:
        return host_copy_bytes(nbytes)

    def cached(self) -> int:
        return cached_pinned_bytes() + self.buffers.free_bytes

    def room(self) -> int:
        """Bytes the GPU can still give: the driver's free memory plus what the caching allocator holds
        unused, less the margin."""
        free, total = torch.cuda.mem_get_info(self.device)
        cached = torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
        return free + cached - _margin(total, GPU_MARGIN)

    def budget(self, model, session, working: int = 0) -> int:
        free, total = torch.cuda.mem_get_info(self.device)
        allocated = torch.cuda.memory_allocated(self.device)
        reserve = _margin(total, GPU_MARGIN) + working
        trained = [p for p in model.parameters() if p.requires_grad and p.device == self.device]
        reserve += sum(p.numel() * p.element_size() for p in trained if p.grad is None)
        if not getattr(session, "trained", {}).get("optimizer_steps", 0):
            reserve += ADAM_MOMENTS * sum(p.numel() * p.element_size() for p in trained)
        return max(0, min(free, total - allocated) - reserve)


class CopyTarget(_HostCopies):
    """The CPU stand-in (tests): the 'host' is a separate CPU tensor, copied to and back through the
    same path. `budget_bytes` plays the GPU budget of "auto"; with `round_pinned` a host copy counts as
    the pinned allocator would reserve it (pinned_bytes); `cached_bytes` plays its free cached blocks;
    copies of at least `exact_min_bytes` go through exact-size buffers (HostBuffers, not page-locked);
    `room_bytes` plays the GPU's room for a prefetch (None: room enough)."""

    name = "copy"

    def __init__(self, budget_bytes: int = 0, round_pinned: bool = False, cached_bytes: int = 0,
                 exact_min_bytes: int | None = None, room_bytes: int | None = None):
        self.budget_bytes = budget_bytes
        self.round_pinned, self.cached_bytes = round_pinned, cached_bytes
        self.exact_min_bytes, self.room_bytes = exact_min_bytes, room_bytes
        self.buffers = HostBuffers(register=False)
        self.device = torch.device("cpu")

    def exact(self, nbytes: int) -> bool:
        return self.exact_min_bytes is not None and nbytes >= self.exact_min_bytes

    def pinned(self, nbytes: int) -> int:
        if self.exact(nbytes):
            return exact_bytes(nbytes)
        return pinned_bytes(nbytes) if self.round_pinned else nbytes

    def cached(self) -> int:
        return self.cached_bytes + self.buffers.free_bytes

    def holds(self, t: torch.Tensor) -> bool:
        return t.device.type == "cpu"

    def to_host(self, t):
        host = self.host_for(t)
        host.copy_(t)
        return host, None

    def to_device(self, host, after):
        dev = torch.empty_strided(host.size(), host.stride(), dtype=host.dtype, device="cpu")
        dev.copy_(host)
        return dev, None

    def ready(self, dev, done) -> None:
        pass

    def room(self) -> int | None:
        return self.room_bytes

    def budget(self, model, session, working: int = 0) -> int:
        return self.budget_bytes


# --------------------------------------------------------------------------- one forward's tensors
class _Handle:
    """What autograd keeps in place of an offloaded tensor: its host copy, and its device copy from the
    fetch until every node that saved it has had it (`saves` packs, counted by get); after that only
    a weak reference, so that the device copy goes when its users let go of it."""

    __slots__ = ("store", "group", "host", "host_done", "dev", "dev_done", "given", "saves", "gets", "nbytes",
                 "pinned", "__weakref__")

    def __init__(self, store: "_Store", group: int, t: torch.Tensor, pinned: int):
        self.store, self.group, self.nbytes, self.pinned = store, group, t.numel() * t.element_size(), pinned
        self.host, self.host_done = store.target.to_host(t)
        self.dev = self.dev_done = self.given = None
        self.saves, self.gets = 1, 0
        store.offloader.host_used += pinned
        store.offloader.stats["offloaded"] += 1
        store.offloader.stats["offloaded_bytes"] += self.nbytes
        store.offloader.stats["pinned_bytes"] += pinned

    def on_device(self) -> torch.Tensor | None:
        """The device copy while it exists: held here, or handed out and still alive."""
        return self.dev if self.dev is not None else (self.given() if self.given is not None else None)

    def fetch(self) -> None:
        if self.on_device() is None:
            self.dev, self.dev_done = self.store.target.to_device(self.host, self.host_done)
            self.store.offloader.stats["fetched"] += 1
            self.store.offloader.note("fetch", self.group)

    def get(self) -> torch.Tensor:
        self.store.offloader.note("get", self.group)
        self.store.arrive(self.group)
        self.fetch()
        dev = self.on_device()
        self.store.target.ready(dev, self.dev_done)
        self.gets += 1
        if self.gets >= self.saves and self.dev is not None:
            # every node that saved it has it now: the copy lives as long as they keep it (a second
            # backward over a retained graph fetches it again if it is gone by then)
            self.given, self.dev = weakref.ref(dev), None
        return dev

    def __del__(self):
        try:
            self.store.offloader.host_used -= self.pinned
            self.store.target.dropped(self.host)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


class _Store:
    """The saved tensors of one training forward, by layer; pack and unpack are autograd's hooks."""

    def __init__(self, offloader: "Offloader", budget: int, working: int = 0):
        self.offloader, self.target, self.budget = offloader, offloader.target, budget
        self.working = working  # one layer's backward working set (working_bytes): kept free of prefetches
        self.group = -1  # the layer whose forward is saving now (-1: before the first)
        self.groups: dict[int, list] = {}  # layer -> weak references to its handles
        self.same: dict[tuple, tuple] = {}  # a tensor saved again -> its handle (this forward only)
        self.kept = 0  # bytes left on the GPU under the budget
        self.arrived: set[int] = set()

    def pack(self, t):
        off = self.offloader
        if not off.candidate(t):
            return t
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype,
               t._version)
        seen = self.same.get(key)
        if seen is not None and seen[0]() is t:
            handle = seen[1]()
            if handle is not None:
                handle.saves += 1
                return handle
        nbytes = t.numel() * t.element_size()
        if self.kept + nbytes <= self.budget:
            self.kept += nbytes
            off.stats["kept"] += 1
            return t
        pinned = self.target.pinned(nbytes)  # what the host copy reserves in pinned memory
        if off.host_used + pinned > off.host_cap:
            off.stats["host_full"] += 1
            return t
        handle = _Handle(self, self.group, t, pinned)
        off.note("offload", self.group, tuple(t.shape))
        self.groups.setdefault(self.group, []).append(weakref.ref(handle))
        try:
            self.same[key] = (weakref.ref(t), weakref.ref(handle))
        except TypeError:  # a tensor without weak references: no sharing
            pass
        return handle

    @staticmethod
    def unpack(saved):
        return saved.get() if isinstance(saved, _Handle) else saved

    def arrive(self, group: int) -> None:
        """The backward reached `group`: bring it back whole and start on the layer before it where the
        GPU has room for that beside this layer's backward (module docstring)."""
        if group in self.arrived:
            return
        self.arrived.add(group)
        for g in (group, group - 1):
            handles = [h for h in (ref() for ref in self.groups.get(g, ())) if h is not None]
            if g != group and not self.room_for(handles):
                self.offloader.note("later", g)
                continue
            for handle in handles:
                handle.fetch()

    def room_for(self, handles) -> bool:
        room = self.target.room()
        if room is None:
            return True
        need = sum(h.nbytes for h in handles if h.on_device() is None)
        return need == 0 or room - self.working >= need

    def done(self) -> None:
        self.same.clear()
        self.target.forward_done()


# --------------------------------------------------------------------------- per model
class Offloader:
    """Host offload for one model (see the module docstring)."""

    def __init__(self, model, session, mode: str, target):
        self.model_ref = weakref.ref(model)
        self.session, self.mode, self.target = session, mode, target
        self.min_bytes = MIN_BYTES  # tests lower it for tiny models
        self.trace: list | None = None  # a list (tests): ("offload" | "fetch" | "get" | "later", layer, ...) in order
        self.host_used = 0
        self.host_cap = 0
        self.checked = False
        self.off_reason = ""
        self.stats = {"forwards": 0, "offloaded": 0, "offloaded_bytes": 0, "pinned_bytes": 0, "kept": 0, "host_full": 0,
                      "fetched": 0}

    def note(self, *event) -> None:
        if self.trace is not None:
            self.trace.append(event)

    def resolve_target(self, model) -> bool:
        """The GPU the model trains on, found at its first training forward (a model may be built on
        the meta device or the CPU and moved); False, and offload off, when it is not on CUDA."""
        if self.target is None:
            device = next((p.device for p in model.parameters() if p.device.type != "meta"), None)
            if device is None or device.type != "cuda":
                where = "no device" if device is None else f"the {device.type} device"
                self.off_reason = f"the model trains on {where}, not a CUDA device"
                say(f"autopatch: host offload off: the model trains on {where}; AUTOPATCH_OFFLOAD keeps a CUDA "
                    f"model's saved activations in host memory (nothing to do here; set AUTOPATCH_OFFLOAD=false "
                    f"to silence this)")
                return False
            self.target = CudaTarget(device)
        return True

    def candidate(self, t) -> bool:
        if type(t) is not torch.Tensor or t.layout != torch.strided or not self.target.holds(t):
            return False  # parameters (nn.Parameter), tensor subclasses, another device
        if t.numel() * t.element_size() < self.min_bytes:
            return False
        if t.is_leaf and t.requires_grad:
            return False
        base = t._base
        return not (base is not None and (isinstance(base, nn.Parameter) or (base.is_leaf and base.requires_grad)))

    # ---------------------------------------------------------------- the forward's hooks
    def enter(self, module, args, kwargs):
        if getattr(_ACTIVE, "store", None) is not None or not module.training or not torch.is_grad_enabled():
            return None
        if torch.compiler.is_compiling() or self.off_reason:
            return None
        if not self.checked:
            self.checked = True
            if not self.resolve_target(module) or not self.check_host(module, args, kwargs):
                return None
        working = working_bytes(module, args, kwargs)
        budget = 0 if self.mode == "true" else self.target.budget(module, self.session, working)
        available = host_available()
        self.host_cap = self.host_used + self.room_on_host(available) if available is not None else 1 << 62
        store = _Store(self, budget, working)
        hooks = torch.autograd.graph.saved_tensors_hooks(store.pack, store.unpack)
        hooks.__enter__()
        _ACTIVE.store, _ACTIVE.hooks, _ACTIVE.owner = store, hooks, self
        self.stats["forwards"] += 1
        return None

    def leave(self, module, args, kwargs, output):
        if getattr(_ACTIVE, "owner", None) is self:
            store, hooks = _ACTIVE.store, _ACTIVE.hooks
            _ACTIVE.store = _ACTIVE.hooks = _ACTIVE.owner = None
            hooks.__exit__(None, None, None)
            store.done()
        return None

    def layer_entered(self, index: int):
        def hook(module, args):
            store = getattr(_ACTIVE, "store", None)
            if store is not None and getattr(_ACTIVE, "owner", None) is self:
                store.group = index
            return None

        return hook

    def room_on_host(self, available: int) -> int:
        """What the host can take from this offloader now: MemAvailable (`available`) and the pinned
        allocator's free cached blocks, which our copies reuse though MemAvailable counts them as used
        (without them a second step would offload less than the first), less the margin of the two."""
        return host_room(available + self.target.cached())

    # ---------------------------------------------------------------- before the first step
    def check_host(self, model, args, kwargs) -> bool:
        """Whether the host can hold what this step would offload; else one line, and offload off."""
        need = estimate_bytes(model, args, kwargs, self.target.pinned)
        if need is None:
            return True
        if self.mode != "true":
            need = max(0, need - self.target.budget(model, self.session, working_bytes(model, args, kwargs)))
        host = host_available()
        if host is None or need == 0:
            return True
        room = self.room_on_host(host)
        if need <= room:
            return True
        self.off_reason = (f"host memory: this step would offload ~{_gib(need)} of saved activations, the host has "
                           f"{_gib(room)} to give ({_gib(host)} available less a margin)")
        say(f"autopatch: host offload off: this training step would keep ~{_gib(need)} of activations in host "
            f"memory and the host has {_gib(room)} to give; shorten the sequence or turn on gradient "
            f"checkpointing to offload less, or set AUTOPATCH_OFFLOAD=false")
        return False


def _config_of(model):
    config = getattr(model, "config", None)
    text = getattr(config, "get_text_config", None)
    try:
        return text() if callable(text) else config
    except Exception:  # noqa: BLE001
        return config


def _tokens(args, kwargs) -> int | None:
    for name in ("input_ids", "inputs_embeds"):
        t = kwargs.get(name)
        if isinstance(t, torch.Tensor):
            return int(t.shape[0] * t.shape[1]) if t.dim() >= 2 else int(t.numel())
    for t in args:
        if isinstance(t, torch.Tensor) and t.dim() >= 2:
            return int(t.shape[0] * t.shape[1])
    return None


def _shape(model, args, kwargs):
    """(tokens, hidden, intermediate, layers, element size) from the config and the input, or None."""
    config = _config_of(model)
    tokens = _tokens(args, kwargs)
    hidden = getattr(config, "hidden_size", None)
    layers = getattr(config, "num_hidden_layers", None)
    if not (tokens and isinstance(hidden, int) and isinstance(layers, int)):
        return None
    inter = getattr(config, "intermediate_size", None)
    inter = inter if isinstance(inter, int) else 4 * hidden
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    return tokens, hidden, inter, layers, torch.empty((), dtype=dtype).element_size()


def estimate_bytes(model, args, kwargs, pinned=None) -> int | None:
    """What one training forward saves in candidate tensors, from the config and the input's tokens:
    under gradient checkpointing each layer's input (tokens × hidden), each counted as `pinned(bytes)`
    when given (what the host copy reserves); else per layer about tokens × (10 × hidden + 3 ×
    intermediate) (the norms', attention's and MLP's saved inputs, of many sizes: not rounded). None
    when the model does not say."""
    shape = _shape(model, args, kwargs)
    if shape is None:
        return None
    tokens, hidden, inter, layers, size = shape
    if _checkpointing(model):
        one = tokens * hidden * size
        return (pinned(one) if pinned is not None else one) * layers
    return tokens * (10 * hidden + 3 * inter) * size * layers


def working_bytes(model, args, kwargs) -> int:
    """What the backward of one layer needs on the GPU beside the saved tensors, kept out of the "auto"
    budget: its activations (recomputed under checkpointing) and their gradients, about
    2 × tokens × (10 × hidden + 3 × intermediate) elements; 0 when the model does not say."""
    shape = _shape(model, args, kwargs)
    if shape is None:
        return 0
    tokens, hidden, inter, _, size = shape
    return 2 * tokens * (10 * hidden + 3 * inter) * size


def _checkpointing(model) -> bool:
    """Whether transformers' activation checkpointing is on (the newer name first: the older one warns)."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(model), name) or name in vars(model):
            try:
                return bool(getattr(model, name))
            except Exception:  # noqa: BLE001
                return False
    return False


def _layers(model) -> list:
    """The children of the model's longest nn.ModuleList (its decoder layers)."""
    best: list = []
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) > len(best):
            best = list(module)
    return best


def mode_of(settings) -> str:
    mode = str(getattr(settings, "offload", "false") or "false").lower()
    return mode if mode in ("auto", "true") else "false"


ATTRIBUTE = "_autopatch_offload"  # where install() keeps a model's Offloader (in its __dict__: no nn.Module lookup)


def offloader_of(model) -> Offloader | None:
    """The Offloader install() put on `model`, or None."""
    return getattr(model, "__dict__", {}).get(ATTRIBUTE)


def install(model, session, settings=None, *, target=None) -> Offloader | None:
    """Offload `model`'s saved tensors in its training forwards as AUTOPATCH_OFFLOAD asks (module
    docstring). Returns the Offloader, or None when the setting is off. `target`: None (the GPU the
    model trains on, found at its first training forward; none there: offload stays off), "copy" or a
    target object (the CPU stand-in for tests). Idempotent."""
    settings = settings if settings is not None else getattr(session, "settings", None)
    mode = mode_of(settings)
    if mode == "false" or not isinstance(model, nn.Module):
        return None
    existing = offloader_of(model)
    if existing is not None:
        return existing
    if target == "copy":
        target = CopyTarget()
    off = Offloader(model, session, mode, target)
    model.register_forward_pre_hook(off.enter, with_kwargs=True)
    model.register_forward_hook(off.leave, with_kwargs=True, always_call=True)
    for index, layer in enumerate(_layers(model)):
        layer.register_forward_pre_hook(off.layer_entered(index))
    vars(model)[ATTRIBUTE] = off
    return off


__all__ = ["install", "offloader_of", "Offloader", "CopyTarget", "CudaTarget", "estimate_bytes", "host_available", "MIN_BYTES"]
