"""GPU primitives shared by more than one op: the facts of a device (SMs, compute capability, shared
memory per SM), launching on a tensor's device, and the Gluon building blocks of the kernels that hold
a row in shared memory, possibly split over a thread-block cluster (cross_entropy_smem, norm_smem):
16-byte cp.async copies, the [CTAS, T, 8] layouts, a cluster barrier, and claiming rows from a global
counter.

Gluon ships with Triton >= 3.4 and has no CPU interpreter: its imports are guarded, so this module
imports everywhere, and the Gluon names below exist only where `gluon_available()` can be true.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Optional

import torch

from fused_kernels._utils import interpreter_on

try:  # Gluon ships with Triton >= 3.4; the CPU interpreter does not run it
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
except ImportError:  # pragma: no cover - an older Triton: the ops' Triton kernels serve every shape
    gluon = None

VEC = 8  # 16-bit elements per thread per chunk: one 16-byte cp.async and one 16-byte shared-memory read
SMEM_RESERVED = 1024  # shared memory the driver reserves per program (CTA) on sm_80+
OFF_GPU_SM_COUNT = 2  # sm_count() of a device that is not a CUDA GPU (see there)


# ----------------------------------------------------------------------------------------------
# Device facts and launching on a tensor's device


def device_index(device: torch.device) -> int:
    """The CUDA device index of `device`: its own, or the current device for a bare "cuda"."""
    return device.index if device.index is not None else torch.cuda.current_device()


def device_guard(t: torch.Tensor):
    """A context that makes t's GPU the current device (Triton launches on the current device, which a
    model split over GPUs does not switch); a no-op when it already is, or off the GPU."""
    if t.is_cuda and t.device.index != torch.cuda.current_device():
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()


def _as_index(device_or_index) -> int:
    if isinstance(device_or_index, int):
        return device_or_index
    return device_index(torch.device(device_or_index))


@functools.lru_cache(maxsize=None)
def _sm_count_of(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device) -> int:
    """Streaming multiprocessors of a CUDA device (looked up once per device). Off the GPU (the CPU
    interpreter) the answer is OFF_GPU_SM_COUNT = 2: an int, so that grid arithmetic never branches on
    a missing value, and small, because the interpreter runs programs one after another and a
    persistent grid of few programs keeps CPU tests cheap."""
    device = torch.device(device) if not isinstance(device, torch.device) else device
    if device.type != "cuda":
        return OFF_GPU_SM_COUNT
    return _sm_count_of(device_index(device))


@functools.lru_cache(maxsize=None)
def _capability_of(index: int) -> tuple[int, int]:
    return tuple(torch.cuda.get_device_capability(index))


def capability(device_or_index) -> tuple[int, int]:
    """(major, minor) compute capability of a CUDA device (a torch.device, "cuda:N" or an index)."""
    return _capability_of(_as_index(device_or_index))


@functools.lru_cache(maxsize=None)
def _smem_per_sm_of(index: int) -> int:
    from triton.runtime import driver

    return int(driver.active.utils.get_device_properties(index)["max_shared_mem"]) + SMEM_RESERVED


def smem_per_sm(device_or_index) -> int:
    """Shared memory (bytes) one SM offers its programs: the per-block opt-in maximum plus the driver's
    per-block reservation (233472 = 228 KiB on an H100/H200, 167936 = 164 KiB on an A100)."""
    return _smem_per_sm_of(_as_index(device_or_index))


def gluon_available() -> bool:
    """Gluon importable and real kernels (not the interpreter): where the Gluon kernels can run at all."""
    return gluon is not None and not interpreter_on()


@dataclasses.dataclass(frozen=True)
class DeviceFacts:
    """What an op's plan() needs to know of a device: whether it is a CUDA GPU, its SMs, compute
    capability and shared memory per SM, and whether the Gluon kernels can run there (Gluon importable,
    real kernels, CUDA rather than ROCm). A plan can be asked for a device it is not running on by
    building one by hand (tests: an H200 is DeviceFacts(True, 132, (9, 0), 233472, True)). `interpreted`:
    the kernels run in Triton's CPU interpreter (OFF_GPU, or a GPU's tensors under TRITON_INTERPRET=1)."""

    cuda: bool
    sm_count: int
    capability: tuple[int, int] = (0, 0)
    smem_per_sm: int = 0
    gluon: bool = False
    interpreted: bool = False  # the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1)

    @property
    def smem_per_block(self) -> int:
        """Shared memory one program (CTA) may opt in to: the SM's less the driver's reservation."""
        return self.smem_per_sm - SMEM_RESERVED


# the CPU, where the kernels run in the interpreter only: no Gluon, no shared memory
OFF_GPU = DeviceFacts(cuda=False, sm_count=OFF_GPU_SM_COUNT, interpreted=True)


@functools.lru_cache(maxsize=None)
def _facts_of(index: int) -> DeviceFacts:
    return DeviceFacts(cuda=True, sm_count=_sm_count_of(index), capability=_capability_of(index),
                       smem_per_sm=_smem_per_sm_of(index), gluon=gluon_available() and torch.version.hip is None,
                       interpreted=interpreter_on())


def device_facts(device) -> DeviceFacts:
    """DeviceFacts of a torch.device (looked up once per GPU); OFF_GPU for anything but a CUDA device."""
    device = torch.device(device) if not isinstance(device, torch.device) else device
    if device.type != "cuda":
        return OFF_GPU
    return _facts_of(device_index(device))


# ----------------------------------------------------------------------------------------------
# Host side of the Gluon kernels: layouts, register caps, the row counter


def register_cap(warps: int, per_sm: float) -> int:
    """Registers per thread that let per_sm CTAs of `warps` warps share an SM's 65536 (allocated in units
    of 8; at most 255): the `maxnreg` a launch gives ptxas so that per_sm CTAs fit."""
    return min(255, 65536 // (int(per_sm) * 32 * warps) // 8 * 8)


def cta_bases(ctas: int) -> list:
    """A cga_layout splitting dim 0 of a [CTAS, T, 8] tensor over the cluster: bit b of the CTA's rank
    steps dim 0 by 2**b, so CTA k holds slice k of every chunk."""
    return [[1 << b, 0, 0] for b in range(ctas.bit_length() - 1)]


@functools.lru_cache(maxsize=None)
def layouts(warps: int, ctas: int):
    """(REG, SMEM) layouts of a [CTAS, T, 8] chunk: each thread owns VEC = 8 consecutive elements (order
    2, 1, 0), in registers and in its 16-byte shared-memory slot; dim 0 spread over a cluster of `ctas`
    CTAs when ctas > 1. Needs Gluon (gluon_available())."""
    split = {} if ctas == 1 else {"cga_layout": cta_bases(ctas)}
    return (gl.BlockedLayout([1, 1, VEC], [1, 32, 1], [1, warps, 1], [2, 1, 0], **split),
            gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0], **split))


@dataclasses.dataclass(frozen=True)
class ClusterShape:
    """A launch shape of norm_smem's kernels: a row split over a cluster of `ctas` CTAs of `warps` warps,
    each thread 8 consecutive 16-bit columns of every chunk."""
    warps: int  # per CTA
    ctas: int  # CTAs per cluster (one row)
    per_sm: int  # CTAs per SM the launch sizes its grid and register cap for

    @property
    def chunk(self) -> int:
        """Columns per chunk: 8 per thread of the cluster (one 16-byte copy each)."""
        return self.ctas * 32 * self.warps * VEC


@dataclasses.dataclass(frozen=True)
class ClusterLaunch:
    """The "cluster" path's config: the shape and how many clusters the persistent grid has."""
    shape: ClusterShape
    clusters: int


def clusters(n_rows: int, shape: ClusterShape, sm_count: int) -> int:
    """The cluster path's persistent grid: at most per_sm CTAs on every SM, in clusters of ctas, and no
    more clusters than it takes to finish the rows in as many rounds (1024 rows over the 66 clusters
    that fit take 16 rounds; 64 clusters take 16 too, evenly, and contend less for the row counter)."""
    fit = max(1, shape.per_sm * sm_count // shape.ctas)
    rounds = -(-n_rows // fit)
    return max(1, -(-n_rows // rounds))


CLUSTER_CAPABILITY = (9, 0)  # thread-block clusters: H100/H200 and later
SIXTEEN_BIT = (torch.bfloat16, torch.float16)  # norm_smem copies 8 columns in 16 bytes


def cluster_refusal(device: DeviceFacts, x_dtype: torch.dtype, weight_dtype) -> str:
    """Why norm_smem's kernels cannot run a call on `device` at all ("" when they can): Gluon, thread-block
    clusters (compute capability >= 9.0), x and the weight (None: none) of one 16-bit dtype."""
    if not device.gluon:
        return "no Gluon here"
    if not device.cuda or device.capability < CLUSTER_CAPABILITY:
        return f"no thread-block clusters (compute capability {device.capability}, not >= 9.0)"
    if x_dtype not in SIXTEEN_BIT or weight_dtype not in (None, x_dtype):
        return f"x ({x_dtype}) and the weight ({weight_dtype}) are not of one 16-bit dtype"
    return ""


def cluster_grid(n_rows: int, n_cols: int, shape: ClusterShape, device: DeviceFacts, *, aligned: bool,
                 min_rows_per_cluster: int) -> tuple[Optional[ClusterLaunch], str]:
    """(the launch, why) of a call the cluster kernels can take, or (None, why not): rows 16-byte aligned
    at a stride of a multiple of 8 elements (`aligned`), and at least min_rows_per_cluster rows per
    cluster of the grid `clusters` gives (fewer, and the per-cluster partial rows and copies of the weight
    cost as much as the rows)."""
    if not aligned:
        return None, "rows not 16-byte aligned at a stride of a multiple of 8 elements"
    grid = clusters(n_rows, shape, device.sm_count)
    if n_rows < min_rows_per_cluster * grid:
        return None, f"{n_rows} rows: fewer than {min_rows_per_cluster} per cluster"
    return ClusterLaunch(shape, grid), (f"rows of {n_cols} read once, in {n_cols // shape.chunk} chunks over "
                                        f"{grid} clusters of {shape.ctas} CTAs x {shape.warps} warps")


def aligned_rows(*rows: torch.Tensor) -> bool:
    """Whether every row of each 2-D tensor may be copied 16 bytes at a time by the cluster kernels
    (16-bit elements: unit column stride, row stride a multiple of 8, 16-byte aligned base)."""
    return all(t2.stride(-1) == 1 and t2.stride(0) % 8 == 0 and t2.data_ptr() % 16 == 0 for t2 in rows)


def aligned_weight(weight) -> bool:
    """Whether a weight (or None) may be copied 16 bytes at a time."""
    return weight is None or (weight.is_contiguous() and weight.data_ptr() % 16 == 0)


_CLAIM_COUNTERS: dict = {}  # (device index, stream) -> its row counter, zero between launches


def claim_counter(device: torch.device) -> torch.Tensor:
    """A zero int32 row counter for one launch of a row-claiming kernel on the current stream. The launch
    leaves it zero (its last claim resets it: claim_row), so one per (device, stream) serves every launch
    there, in stream order, and no fill kernel runs per launch. While the stream is capturing a CUDA
    graph, a new zeroed one instead: its fill is part of the graph, and memory allocated during capture
    belongs to the graph's pool."""
    if torch.cuda.is_current_stream_capturing():
        return torch.zeros(1, dtype=torch.int32, device=device)
    index = device_index(device)
    key = (index, torch.cuda.current_stream(index).cuda_stream)
    counter = _CLAIM_COUNTERS.get(key)
    if counter is None:
        counter = _CLAIM_COUNTERS[key] = torch.zeros(1, dtype=torch.int32, device=torch.device("cuda", index))
    return counter


# ----------------------------------------------------------------------------------------------
# Device side (Gluon): copies, offsets, the cluster barrier, row claiming


def lead_ptx(tid: str) -> str:
    """PTX: predicate `lead` = thread 0 of CTA 0 of the cluster (register `tid` holds %tid.x afterwards;
    needs registers `who` and predicate `lead` declared)."""
    return (f"mov.u32 who, %cluster_ctarank;\n\tmov.u32 {tid}, %tid.x;\n\tor.b32 who, who, {tid};\n\t"
            "setp.eq.u32 lead, who, 0;\n\t")


def publish_ptx(got: str, slot: str, last_claim: str, counter: str) -> str:
    """PTX for lead: *slot = got, and *counter = 0 when got is the launch's last claim (needs predicate
    `last` declared)."""
    return (f"@lead st.global.u32 [{slot}], {got};\n\tsetp.eq.and.u32 last, {got}, {last_claim}, lead;\n\t"
            f"@last st.global.u32 [{counter}], 0;\n\t")


if gluon is not None:
    # async_load(buffer, pointers, mask=None): a cp.async of global memory into a shared-memory buffer
    # (16 bytes per thread here). Triton 3.6 names it async_copy_global_to_shared; later versions async_load.
    async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared

    @gluon.jit
    def slice_offsets(CTAS: gl.constexpr, T: gl.constexpr, REG: gl.constexpr):
        """[CTAS, T, 8] offsets within a chunk of CTAS·T·8 elements (columns) in layout REG: CTA k's slice
        is k·T·8 onwards, thread t's 8 consecutive ones t·8 onwards within it."""
        per_thread: gl.constexpr = gl.SliceLayout(2, REG)
        ranks = gl.arange(0, CTAS, layout=gl.SliceLayout(1, per_thread))
        threads = gl.arange(0, T, layout=gl.SliceLayout(0, per_thread))
        lanes = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, REG)))
        return gl.expand_dims(gl.expand_dims(ranks, 1), 2) * (T * 8) + \
            gl.expand_dims(gl.expand_dims(threads, 0), 2) * 8 + gl.expand_dims(gl.expand_dims(lanes, 0), 1)

    @gluon.jit
    def cluster_sync():
        """barrier.cluster with release / acquire semantics: each CTA's global stores before it are seen
        by every CTA of the cluster after it. Inline PTX: Triton 3.6's Gluon has no cluster barrier."""
        gl.inline_asm_elementwise("barrier.cluster.arrive.release.aligned;\n\t"
                                  "barrier.cluster.wait.acquire.aligned;\n\tmov.u32 $0, 0;",
                                  "=r", [], dtype=gl.int32, is_pure=False, pack=1)

    # Row claiming: thread 0 of CTA 0 of the cluster (`lead`) takes counter++ for the cluster. The claim
    # numbered last_claim is a launch's last (every row once, plus one past the end per cluster: n_rows +
    # clusters claims), so its taker sets the counter back to 0 for the next launch on the stream
    # (claim_counter); -1 never resets it. Inline PTX: Gluon's atomic would broadcast its result to every
    # thread of the cluster, with two more cluster barriers.
    CLAIM_ROW_PTX = gl.constexpr(
        "{\n\t.reg .pred lead, last;\n\t.reg .b32 who, got;\n\t" + lead_ptx("got")  # got = %tid.x off lead
        + "@lead atom.global.add.u32 got, [$1], 1;\n\t" + publish_ptx("got", "$2", "$3", "$1") + "mov.u32 $0, 0;\n\t}")
    CLAIM_ISSUE_PTX = gl.constexpr(
        "{\n\t.reg .pred lead;\n\t.reg .b32 who, tid;\n\t" + lead_ptx("tid")
        + "mov.u32 $0, 0;\n\t@lead atom.global.add.u32 $0, [$1], 1;\n\t}")
    CLAIM_PUBLISH_PTX = gl.constexpr(
        "{\n\t.reg .pred lead, last;\n\t.reg .b32 who, tid;\n\t" + lead_ptx("tid") + publish_ptx("$3", "$2", "$4", "$1")
        + "mov.u32 $0, 0;\n\t}")

    @gluon.jit
    def claim_row(counter_ptr, slot_ptr, last_claim=-1):
        """lead: *slot = counter++ (seen by the cluster after the cluster_sync that follows), with the
        counter reset on the launch's last claim."""
        gl.inline_asm_elementwise(CLAIM_ROW_PTX, "=r,l,l,r", [counter_ptr, slot_ptr, last_claim], dtype=gl.int32,
                                  is_pure=False, pack=1)

    @gluon.jit
    def claim_issue(counter_ptr):
        """lead: counter++, returned (the other threads get 0); claim_publish stores it later, so the
        atomic's round trip can overlap work."""
        return gl.inline_asm_elementwise(CLAIM_ISSUE_PTX, "=r,l", [counter_ptr], dtype=gl.int32, is_pure=False,
                                         pack=1)

    @gluon.jit
    def claim_publish(counter_ptr, slot_ptr, got, last_claim):
        """lead: *slot = got (claim_issue's), with the counter reset on the launch's last claim."""
        gl.inline_asm_elementwise(CLAIM_PUBLISH_PTX, "=r,l,l,r,r", [counter_ptr, slot_ptr, got, last_claim],
                                  dtype=gl.int32, is_pure=False, pack=1)
