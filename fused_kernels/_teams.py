"""Teams of programs that share a row held in registers (Triton helpers and the host-side sizing).

A kernel that needs a whole row's statistics before it can write anything (a norm's backward, a cross
entropy's gradient) must read each row twice unless the row stays on chip in between. A row too long
for one program's registers can still stay on chip across a *team* of n_seg programs: member k holds
columns [k·SEG, (k+1)·SEG) in registers, writes its partial statistics to a small fp32 buffer,
counts itself in the row's arrival counter (bar.sync, then one red.release), waits until all n_seg
members of the row are counted (acquire spin), combines the partials and writes its columns. Each
element is read from HBM once and written once: the bytes of the floor.

Teams are persistent: the grid is n_teams·n_seg programs; team j takes rows j, j + n_teams, ...
Residency: a member waits only for members of its own team. A program learns its (team, member) from
an atomic ticket taken when it starts (not from program_id, whose dispatch order CUDA does not
promise), so the members holding tickets are running. Teams whose tickets are all handed out finish
without help and free their slots; the one team with tickets still to hand out is completed by the
programs that start next. Nothing can hang as long as n_seg programs fit on the GPU at once (n_seg ≤ 64
here against ≥ 132 SMs × several programs), whatever else shares the SMs.

The CPU interpreter runs programs one after another, so a member would wait forever for the next
one. There the kernels run as two launches instead (PHASE 1: partials only; PHASE 2: re-read, combine
and write, no counters), which tests everything but the wait; PHASE 0, the GPU's, is the one launch.

counters (int32, zeroed per launch): [0] the ticket, [1 + row] the row's arrived members.
"""

from __future__ import annotations

import triton
import triton.language as tl

# PHASE values of the team kernels
ONE_LAUNCH, PARTIALS_ONLY, COMBINE_ONLY = 0, 1, 2


@triton.jit
def team_slot(counters_ptr, n_seg, PHASE: tl.constexpr):
    """(team, member, number of teams) of this program."""
    if PHASE == 0:
        t = tl.atomic_add(counters_ptr, 1)
    else:
        t = tl.program_id(0)
    return t // n_seg, t % n_seg, tl.num_programs(0) // n_seg


@triton.jit
def arrive(counters_ptr, row):
    """After a member's partial-statistics stores: every thread's stores, then one release add."""
    tl.debug_barrier()
    tl.atomic_add(counters_ptr + 1 + row, 1, sem="release")


@triton.jit
def wait_for_team(counters_ptr, row, n_seg):
    """Before reading the row's partials: spin on an acquire load until its n_seg members arrived."""
    done = tl.atomic_add(counters_ptr + 1 + row, 0, sem="acquire")
    while done < n_seg:
        done = tl.atomic_add(counters_ptr + 1 + row, 0, sem="acquire")


def team_grid(n_rows: int, n_seg: int, programs_per_sm: float, sm_count: int) -> int:
    """Programs to launch: a whole number of teams, about programs_per_sm per SM, at least one team,
    never more teams than rows."""
    teams = max(1, min(n_rows, int(programs_per_sm * sm_count) // n_seg))
    return teams * n_seg
