"""rope's launch configs and its one `plan(call, device)`: a fixed config ("fixed": the heuristic under
the CPU interpreter, or one forced) or triton.autotune's choice on a GPU ("autotune", among
`candidate_configs`), and why. Plain Python, no kernels (fused_kernels/ops/rope.py builds the
autotuner's triton.Config list from `_TILE_SIZES` and `_WARPS`)."""

from __future__ import annotations

import dataclasses
from typing import Optional

from fused_kernels._dispatch import Path, Plan
from fused_kernels._gpu import DeviceFacts
from fused_kernels._ints import cdiv, next_pow2

_CONFIG = {
    "force": None,  # a RopeConfig every launch uses, on any device (tests, dev/tune_rope.py)
    "device": None,  # DeviceFacts standing in for q's device when rope plans a launch (tests)
}


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    block_t: int   # tokens per program
    block_hq: int  # q heads per tile
    block_hk: int  # k heads per tile
    num_warps: int

    def meta(self) -> dict:
        """The kernel's constexpr arguments that this config sets."""
        return dict(BLOCK_T=self.block_t, BLOCK_HQ=self.block_hq, BLOCK_HK=self.block_hk)


def heuristic_config(n_tokens: int, n_q_heads: int, n_k_heads: int, head_dim: int) -> RopeConfig:
    """Block sizes for one launch (n_tokens = batch * seq; head_dim = the larger of q's and k's), without
    measuring: what the CPU interpreter runs.

    Memory-bound streaming: each loop step of a program moves a tile of ~4096 elements of q (or k),
    as many heads of as few tokens as fit, so that a thread issues a few 16-byte vector loads per step, the
    cos/sin a thread keeps in registers (one token's channels) stay few, and the grid has many programs.
    Llama-3-8B (16384 tokens, 32/8 heads, head_dim 128): 1 token x 32 q heads (x 8 k heads), 4 warps,
    16384 programs, 80 registers per thread (ptxas, sm_90a); 4 tokens x 8 heads took 121."""
    tile_elems = 4096
    d = next_pow2(max(head_dim, 2))
    block_hq = min(next_pow2(max(n_q_heads, 1)), max(1, tile_elems // d))
    block_t = max(1, tile_elems // (block_hq * d))
    block_t = min(block_t, next_pow2(max(n_tokens, 1)))
    block_hk = min(next_pow2(max(n_k_heads, 1)), max(1, tile_elems // (block_t * d)))
    return RopeConfig(block_t=block_t, block_hq=block_hq, block_hk=block_hk, num_warps=4)


@dataclasses.dataclass(frozen=True)
class Call:
    """What plan() reads of one launch: n_tokens = batch · seq tokens of n_q_heads / n_k_heads heads,
    head_dim the larger of q's and k's."""
    n_tokens: int
    n_q_heads: int
    n_k_heads: int
    head_dim: int


def plan(call: Call, device: DeviceFacts) -> Plan:
    """How rope launches, and why. Path "fixed": one RopeConfig, the heuristic's where `device.interpreted`
    (the CPU interpreter) or `_CONFIG["force"]`'s. Path "autotune" (a GPU; config None): triton.autotune
    times `candidate_configs` once per key (head counts, head dims, rot, variant, direction, dtypes, the
    token count's power-of-two bucket) and later launches reuse the winner: the best tile depends on the
    chip (neighbouring configs differ by 2x on the H200). Llama-3-8B under the interpreter (16384 tokens,
    32 / 8 heads, head_dim 128): fixed, 1 token x 32 q heads x 8 k heads per program, 4 warps."""
    n_tokens, n_q_heads, n_k_heads, head_dim = call.n_tokens, call.n_q_heads, call.n_k_heads, call.head_dim
    cfg: Optional[RopeConfig] = _CONFIG["force"]
    if cfg is not None:
        why = "_CONFIG['force'] forces it"
    elif device.interpreted:
        cfg, why = heuristic_config(n_tokens, n_q_heads, n_k_heads, head_dim), "the CPU interpreter: heuristic_config"
    else:
        return Plan(Path.AUTOTUNE, None, f"a GPU: triton.autotune picks among candidate_configs({n_q_heads}, "
                                         f"{n_k_heads}, {head_dim}, {_token_bucket(n_tokens)}), once per key")
    return Plan(Path.FIXED, cfg, f"{why}; {cfg.block_t} token(s) x {cfg.block_hq} q heads x {cfg.block_hk} k heads "
                                 f"per program, {cfg.num_warps} warps, {cdiv(max(n_tokens, 1), cfg.block_t)} programs")


# The autotuner's static config list: every (tokens, q heads, k heads per tile, warps) it may be asked
# to run; `_prune` keeps the few that `candidate_configs` names for the call's head counts and head_dim.
_TILE_SIZES = (1, 2, 4, 8, 16, 32, 64)
_WARPS = (1, 2, 4, 8)


def candidate_configs(n_q_heads: int, n_k_heads: int, head_dim: int, token_bucket: int = 1 << 16) -> list[RopeConfig]:
    """The configs the autotuner times for one (head counts, head_dim): tiles of 512–8192 elements of q (at
    least 512 unless that is all of a token's heads), 8, 16 or 32 values per thread; several tokens per
    program only when a tile already holds all of a token's q heads and stays within 4096 elements; k tiles
    take as many heads as the q tile, or all k heads if fewer. Always at least one config."""
    d = next_pow2(max(head_dim, 2))
    hq2, hk2 = next_pow2(max(n_q_heads, 1)), next_pow2(max(n_k_heads, 1))
    out = []
    for block_t in _TILE_SIZES:
        if block_t > 1 and block_t > token_bucket:
            break
        for block_hq in _TILE_SIZES:
            if block_hq > hq2:
                break
            tile = block_t * block_hq * d
            if block_hq < hq2 and block_hq * d < 512:
                continue  # small head tiles only when they hold all heads
            if block_t > 1 and (block_hq < hq2 or tile > 4096):
                continue
            if tile > 8192:
                continue
            for num_warps in _WARPS:
                per_thread = tile // (32 * num_warps)
                if per_thread in (8, 16, 32) and (num_warps > 1 or tile <= 512):
                    out.append(RopeConfig(block_t, block_hq, min(block_hq, hk2), num_warps))
    if not out:  # tiny tiles (e.g. head_dim 2, one head): one warp, all heads of one token
        block_hq = min(hq2, _TILE_SIZES[-1])
        out.append(RopeConfig(1, block_hq, min(block_hq, hk2), 1))
    return out


def _config_key(meta: dict, num_warps: int) -> tuple:
    return meta["BLOCK_T"], meta["BLOCK_HQ"], meta["BLOCK_HK"], num_warps


def _prune(configs, named_args, **kwargs):
    """triton.autotune's early_config_prune: the candidates for this call's head counts and head_dim."""
    wanted = {
        _config_key(c.meta(), c.num_warps)
        for c in candidate_configs(named_args["n_q_heads"], named_args["n_k_heads"],
                                   max(named_args["q_head_dim"], named_args["k_head_dim"]), named_args["token_bucket"])
    }
    return [c for c in configs if _config_key(c.kwargs, c.num_warps) in wanted]


def _token_bucket(n_tokens: int) -> int:
    """Part of the autotuning key: tokens rounded up to a power of two (1 .. 65536)."""
    return min(next_pow2(max(n_tokens, 1)), 1 << 16)
