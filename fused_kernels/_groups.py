"""Work items over L2-sized row groups, handed out in a fixed order by an atomic ticket (Triton helpers).

A kernel that needs a whole row's statistics before it can write anything (a norm's backward, a
cross entropy's gradient) reads each row twice. Taken in groups of rows whose data fit in L2, the
second read comes from L2: the first-phase items (A) of group g+1 run before the second-phase items (B)
of group g, and a B item waits until all A items of its group are counted.

Ticket order: A(0), A(1), B(0), A(2), B(1), ..., A(G-1), B(G-2), B(G-1). A program takes the next
ticket when it finishes an item, so an item it waits for holds a lower ticket: it is running or done,
whatever the number of programs resident at once (no deadlock when SMs are shared). Under the CPU
interpreter one program runs every ticket in order, so a wait on a later item would hang the tests.

counters (int32, zeroed per launch): [0] the ticket, [1 + g] the finished A items of group g.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def next_ticket(counters_ptr):
    return tl.atomic_add(counters_ptr, 1)


@triton.jit
def group_item(t, a_items, b_items, n_groups):
    """(is_a, group, index within the phase's items of that group) of ticket t (t < n_groups·(a+b))."""
    pair = a_items + b_items
    t2 = tl.maximum(t - a_items, 0)
    k = t2 // pair
    off = t2 - k * pair
    first = t < a_items
    last = k >= n_groups - 1
    is_a = first | ((k < n_groups - 1) & (off < a_items))
    grp = tl.where(first, 0, tl.where(is_a, k + 1, k))
    idx = tl.where(first, t, tl.where(is_a | last, off, off - a_items))
    return is_a, grp, idx


@triton.jit
def count_a_done(counters_ptr, grp):
    """After an A item's stores: every thread's stores, then one release add (bar.sync, red.release)."""
    tl.debug_barrier()
    tl.atomic_add(counters_ptr + 1 + grp, 1, sem="release")


@triton.jit
def wait_a_done(counters_ptr, grp, a_items):
    """Before a B item's loads: spin on an acquire load until group grp's A items are all counted."""
    done = tl.atomic_add(counters_ptr + 1 + grp, 0, sem="acquire")
    while done < a_items:
        done = tl.atomic_add(counters_ptr + 1 + grp, 0, sem="acquire")
