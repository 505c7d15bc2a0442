"""Exact-size page-locked host buffers for the offloader's large copies, reused from step to step.

PyTorch's caching host allocator rounds every pinned request up to a power of two (its free lists
are power-of-two buckets): a 500000-token checkpoint of a 4096-wide bf16 model (3.81 GiB) takes
4 GiB, one of 270000 tokens (2.06 GiB) takes 4 GiB too: up to half of the host lost at long
context. A buffer here is anonymous host pages (mmap) page-locked with cudaHostRegister, of the size
asked (to a page), unlocked when the last tensor over them goes. A buffer given back goes to a free
list by size and the next copy of that size (or up to FIT smaller) takes it: the same length every
step, every buffer reused, nothing registered again.
A copy that no free buffer fits first frees them all (the host's room counted them as free), and
buffers left untaken through a whole forward are freed at its end (`sweep`).

Ordering: every copy into or out of a buffer runs on the one side stream of the owner (`stream`),
so a buffer taken again is written only after the copies that read it; before buffers are
unregistered the side stream is synchronized. `register=False` (tests on the CPU) keeps the
bookkeeping and skips the page-locking.
"""

from __future__ import annotations

import collections
import mmap
import threading

import torch

PAGE = 4096
FIT = 1.25  # a free buffer up to this much larger than asked is taken (lengths that vary a little)


def exact_bytes(nbytes: int) -> int:
    """What a buffer for `nbytes` holds of the host: the request to a whole page."""
    return -(-nbytes // PAGE) * PAGE


class HostBuffers:
    """Free lists of page-locked host buffers by exact size (see the module docstring)."""

    def __init__(self, stream=None, register: bool = True):
        self.stream, self.register = stream, register
        self._lock = threading.Lock()
        self._free: dict[int, list] = {}  # size -> free buffers (uint8 tensors) of that size
        self._taken: dict[int, torch.Tensor] = {}  # data_ptr -> a buffer handed out
        self._untaken_since_sweep: set[int] = set()  # data_ptrs of free buffers not taken since the last sweep
        # give() only appends here (deque.append is atomic): it runs from handles' __del__, which the
        # garbage collector may call on this thread inside one of our locked sections
        self._given: collections.deque = collections.deque()
        self._free_bytes = 0  # in the free lists
        self.held_bytes = 0  # registered in all (free and handed out)
        self.registered = 0  # buffers page-locked so far (a step at an unchanged length adds none)

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 host buffer of at least exact_bytes(nbytes), free of pending copies on `stream`: a
        free one of that size, else the smallest free one up to FIT larger (lengths that vary a
        little), else a new one, after the free ones are released (they fit none of this step's
        copies, and the host's room counted them as free)."""
        size = exact_bytes(nbytes)
        stale = []
        with self._lock:
            self._settle()
            sizes = [n for n, free in self._free.items() if free and size <= n <= size * FIT]
            buf = self._free[min(sizes)].pop() if sizes else None
            if buf is not None:
                self._free_bytes -= buf.numel()
                self._untaken_since_sweep.discard(buf.data_ptr())
            else:
                stale = [b for free in self._free.values() for b in free]
                self._free.clear()
                self._untaken_since_sweep.clear()
                self._free_bytes = 0
        if buf is None:
            self._release(stale)
            buf = self._new(size)
        with self._lock:
            self._taken[buf.data_ptr()] = buf
        return buf

    def host_like(self, t: torch.Tensor, stride) -> torch.Tensor:
        """A host tensor of t's size, dtype and `stride` over a buffer from take()."""
        nbytes = t.numel() * t.element_size()
        return self.take(nbytes)[:nbytes].view(t.dtype).as_strided(t.size(), stride)

    def give(self, ptr: int) -> None:
        """The buffer at `ptr` (a take()'s data_ptr) is no longer read by anyone but queued copies."""
        self._given.append(ptr)

    @property
    def free_bytes(self) -> int:
        """Bytes in the free lists (buffers given back included)."""
        with self._lock:
            self._settle()
            return self._free_bytes

    def _settle(self) -> None:
        """Move the buffers given back to the free lists (under the lock)."""
        while self._given:
            buf = self._taken.pop(self._given.popleft(), None)
            if buf is not None:
                self._free.setdefault(buf.numel(), []).append(buf)
                self._free_bytes += buf.numel()

    def sweep(self) -> int:
        """Free the buffers that stayed in the free lists since the last sweep (one forward). Returns
        the bytes freed."""
        with self._lock:
            self._settle()
            untaken = self._untaken_since_sweep
            stale = [b for bufs in self._free.values() for b in bufs if b.data_ptr() in untaken]
            self._free = {size: kept for size, bufs in self._free.items()
                          if (kept := [b for b in bufs if b.data_ptr() not in untaken])}
            freed = sum(b.numel() for b in stale)
            self._free_bytes -= freed
            self._untaken_since_sweep = {b.data_ptr() for bufs in self._free.values() for b in bufs}
        self._release(stale)
        return freed

    def clear(self) -> None:
        """Free every buffer in the free lists (handed-out ones stay theirs)."""
        with self._lock:
            self._settle()
            bufs = [b for free in self._free.values() for b in free]
            self._free.clear()
            self._untaken_since_sweep.clear()
            self._free_bytes = 0
        self._release(bufs)

    def __del__(self):
        try:
            if self.register and self.stream is not None:
                self.stream.synchronize()  # the buffers' pages are unlocked as their last views go
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    # ---------------------------------------------------------------- page-locking
    def _new(self, size: int) -> torch.Tensor:
        pages = _LockedPages(size, self.register)
        buf = torch.frombuffer(pages, dtype=torch.uint8)  # holds `pages` until its last view goes
        with self._lock:
            self.held_bytes += size
            self.registered += 1
        return buf

    def _release(self, bufs) -> None:
        """Drop buffers no copy uses any more; each is unlocked and unmapped when its last view goes."""
        if not bufs:
            return
        if self.register and self.stream is not None:
            self.stream.synchronize()  # no queued copy may still read or write them
        with self._lock:
            self.held_bytes -= sum(b.numel() for b in bufs)


class _LockedPages(mmap.mmap):
    """Anonymous pages (page-aligned), page-locked with cudaHostRegister while `register`; unlocked
    before they are unmapped, when the last tensor over them is gone (memory freed while still
    registered would make the next registration of that range fail)."""

    def __new__(cls, size: int, register: bool):
        return super().__new__(cls, -1, size)

    def __init__(self, size: int, register: bool):
        self.locked = False
        self.address = torch.frombuffer(self, dtype=torch.uint8, count=1).data_ptr()
        if register:
            err = torch.cuda.cudart().cudaHostRegister(self.address, size, 0)
            if int(err) != 0:
                raise RuntimeError(f"cudaHostRegister of {size} bytes failed (cudaError {int(err)}); the host may "
                                   "be short of lockable memory (ulimit -l) or of memory")
            self.locked = True

    def __del__(self):
        if self.locked:
            self.locked = False
            try:
                torch.cuda.cudart().cudaHostUnregister(self.address)
            except Exception:  # noqa: BLE001 - interpreter shutdown
                pass
