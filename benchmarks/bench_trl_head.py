"""TRL 1.16's chunked LM head against our fused linear cross entropy and a plain torch head.

    python3 benchmarks/bench_trl_head.py --out trl_head.json [--budget-s 400]            # on CUDA
    TRITON_INTERPRET=1 python3 benchmarks/bench_trl_head.py --tiny --out /tmp/t.json     # CPU dry run

What TRL's trainers run (docs/kernels/fused_linear_cross_entropy.md, "TRL's fused head"):
`trl.kernels.ChunkedLogProbFunction.apply(hidden, weight, bias, labels, temperature, 32768, softcap,
logit_scale, outputs)` on the tokens whose label is not -100 (the head drops the others before the
call, so every token here is valid). Each row is one head shape × one trainer's output set:

    sft                 log_probs, entropy, is_top1                                   T = 1
    dpo                 log_probs, entropy, mean_logits, is_top1, log_sum_sq_probs    T = 1 (WPO on)
    grpo                log_probs, entropy                                            T = 0.7
    grpo_entropy_bonus  as grpo, the entropy in the loss too (entropy_coef != 0)

The loss backpropagated is Σ g·log_probs (+ Σ g'·entropy for the bonus) with random per-token weights
g, g' (advantages, 1 / tokens); only log_probs (and the bonus' entropy) carry a gradient, as in TRL.

Peers, in one process, on the same fresh inputs (bf16, hidden ~ N(0, 1), weight ~ N(0, 0.05²)):
- trl:   ChunkedLogProbFunction with the outputs the trainer asks for.
- ours:  fused_linear_cross_entropy(reduction="none", logit_scale=1/T, stats=...): log_probs = −loss
         (its backward recomputes the logits), plus every side output our `stats` offers; the ones it
         does not offer are listed under "missing" (ours then computes less than TRL). Entropy with a
         gradient has no counterpart: that row says "unsupported".
- torch: logits = hidden @ weight.T in bf16, then float32 log_softmax and the outputs from it (the full
         [tokens, vocab] tensors); skipped when it cannot fit.

Per peer: `ms` — forward + backward, the median of triton.testing.do_bench (warm-up, L2 flushed,
GPU time; a perf_counter median on the CPU); `peak_extra_bytes` — peak allocated during one call
beyond what was allocated before it (inputs), less the gradients it leaves; `peak_beyond_inputs_bytes`
— the same with those gradients; `check` — the peer run again on the first `--check-tokens` tokens
(half of whose targets are made the arg-max, so is_top1 is neither all nor none) against a float64
torch reference of the same bf16 inputs: rel_err[name] = ||out − ref|| / ||ref|| for every output and
for grad_hidden / grad_weight (a reference that is all zeros is an error, never a pass),
is_top1_mismatch = the number of tokens that differ, max_rel_err = the largest rel_err.

Output (JSON at --out, rewritten after every row so a killed run keeps what it measured):
    {"environment": {...}, "args": {...},
     "trl": {"importable": bool, "version": str|None, "error": str|None, "backward_gather": str},
     "ours_stats": [names our stats= accepts],
     "rows": [{"case", "hidden", "vocab", "tokens", "dtype", "set", "outputs", "grad_outputs",
               "temperature",
               "peers": {"trl"|"ours"|"torch": {"status": "ok"|"failed"|"skipped"|"unsupported"|
                                                "unavailable"|"does_not_fit", "ms", "peak_extra_bytes",
                                                "peak_beyond_inputs_bytes", "outputs_computed",
                                                "missing", "check": {...}, "error"}},
               "trl_ms_over_ours_ms": float|None (> 1: ours is faster), "torch_ms_over_ours_ms"}],
     "timer": how "ms" was taken,
     "summary": [{"case", "set", "trl_ms_over_ours_ms", "<peer>_ms", "<peer>_peak_extra_mib",
                  "<peer>_max_rel_err", "<peer>_missing"}] (the rows, flat; written at the end),
     "status": "complete" | "budget spent" | "failed: ...", "wall_s": float}
Exit status 0 when every row ran (ours may be "unsupported", torch "does_not_fit"), 2 when a peer failed
or the budget ran out, 3 when there is no device to run on or an argument is wrong, 4 when everything
else ran but TRL is not importable (its peer says "unavailable"; the reason is in "trl" and on stderr).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import time
import traceback
import types

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(1, os.path.dirname(HERE))

import torch  # noqa: E402

import bench_common as bc  # noqa: E402

OUTPUT_SETS = {
    # name: (outputs, outputs in the loss, temperature)
    "sft": (("log_probs", "entropy", "is_top1"), ("log_probs",), 1.0),
    "dpo": (("log_probs", "entropy", "mean_logits", "is_top1", "log_sum_sq_probs"), ("log_probs",), 1.0),
    "grpo": (("log_probs", "entropy"), ("log_probs",), 0.7),
    "grpo_entropy_bonus": (("log_probs", "entropy"), ("log_probs", "entropy"), 0.7),
}
TRL_OPTIONAL = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")  # the order TRL returns them
SHAPES = {  # name: (hidden, vocab)
    "qwen3_0.6b": (1024, 151936),
    "llama3.2_3b": (3072, 128256),
}
TINY_SHAPES = {"tiny_a": (32, 300), "tiny_b": (48, 257)}
TRL_VOCAB_CHUNK = 32768  # what add_fused_lm_head passes
TINY_TRL_VOCAB_CHUNK = 128  # several vocabulary tiles at the tiny shapes
WEIGHT_STD = 0.05
PEERS = ("trl", "ours", "torch")


# ----------------------------------------------------------------------------------------------
# TRL


def load_trl() -> tuple[object | None, dict]:
    """(ChunkedLogProbFunction or None, what happened). The kernel module needs only torch, triton and
    transformers; its backward imports trl.trainer.utils (accelerate, datasets, pandas) for the ZeRO-3
    gather alone. Where that import fails, a stand-in with the null gather TRL itself uses outside
    ZeRO-3 takes its place, and the JSON says so."""
    info = {"importable": False, "version": bc.version_of("trl"), "error": None, "backward_gather": None}
    try:
        from trl.kernels.chunked_logprob import ChunkedLogProbFunction
    except Exception as exc:  # noqa: BLE001 - any import failure means no TRL peer
        info["error"] = (f"trl is not importable ({type(exc).__name__}: {exc}); install TRL 1.16 (carry its "
                         f"wheel, e.g. .whl/trl-1.16.0-py3-none-any.whl) to measure TRL's head")
        return None, info
    info["importable"] = True
    try:
        from trl.trainer.utils import maybe_gather_lm_head_ctx  # noqa: F401

        info["backward_gather"] = "trl.trainer.utils.maybe_gather_lm_head_ctx"
    except Exception as exc:  # noqa: BLE001
        stub = types.ModuleType("trl.trainer.utils")
        stub.maybe_gather_lm_head_ctx = lambda *params: contextlib.nullcontext()
        sys.modules["trl.trainer.utils"] = stub
        info["backward_gather"] = (f"null context (trl.trainer.utils not importable: {type(exc).__name__}: "
                                   f"{exc}); the same as TRL's own outside DeepSpeed ZeRO-3")
    return ChunkedLogProbFunction, info


def run_trl(fn, h, w, t, outputs, temperature, vocab_chunk):
    res = fn.apply(h, w, None, t, temperature, vocab_chunk, None, 1.0, tuple(outputs))
    out = {"log_probs": res[0]}
    for name, value in zip(TRL_OPTIONAL, res[1:]):
        if value is not None:
            out[name] = value
    return out


# ----------------------------------------------------------------------------------------------
# Ours


def ours_stats_supported(device) -> list[str]:
    """The side outputs our fused linear cross entropy's `stats` accepts (asked of the kernel itself)."""
    import fused_kernels as fk

    h = torch.randn(4, 8, device=device)
    w = torch.randn(6, 8, device=device)
    t = torch.randint(0, 6, (4,), device=device)
    ok = []
    for name in ("token_loss", "is_top1", "entropy", "log_sum_sq_probs", "mean_logits"):
        try:
            fk.fused_linear_cross_entropy(h, w, t, reduction="none", stats={name: None})
            ok.append(name)
        except ValueError:
            pass
    return ok


def run_ours(h, w, t, outputs, temperature, supported):
    import fused_kernels as fk

    wanted = [o for o in outputs if o != "log_probs" and o in supported]
    stats = {name: None for name in wanted} if wanted else None
    loss = fk.fused_linear_cross_entropy(h, w, t, reduction="none", logit_scale=1.0 / temperature, stats=stats)
    out = {"log_probs": -loss}
    for name in wanted:
        out[name] = stats[name]
    return out


# ----------------------------------------------------------------------------------------------
# Plain torch


def torch_outputs(logits, t, outputs, temperature):
    """Every output from full logits (any float dtype; the math in that dtype or float32, whichever is
    wider), as TRL defines them."""
    z = logits.float() if logits.dtype in (torch.bfloat16, torch.float16) else logits
    if temperature != 1.0:
        z = z / temperature
    logp = torch.log_softmax(z, dim=-1)
    out = {"log_probs": logp.gather(-1, t.unsqueeze(-1)).squeeze(-1)}
    if "entropy" in outputs:
        out["entropy"] = -(logp.exp() * logp).sum(-1)
    if "log_sum_sq_probs" in outputs:
        out["log_sum_sq_probs"] = torch.logsumexp(2 * logp.detach(), dim=-1)
    if "mean_logits" in outputs:
        out["mean_logits"] = z.detach().mean(-1)
    if "is_top1" in outputs:
        out["is_top1"] = z.detach().argmax(-1) == t
    return out


def run_torch(h, w, t, outputs, temperature):
    return torch_outputs(h @ w.t(), t, outputs, temperature)


def torch_bytes(n, v) -> int:
    # bf16 logits, fp32 logits, log_softmax, its exp and the product, and their gradients: ~11 fp32 N x V
    return n * v * (2 + 4 * 11)


# ----------------------------------------------------------------------------------------------
# One row


def _loss(out, grad_outputs, g):
    total = None
    for i, name in enumerate(grad_outputs):
        term = (out[name] * g[i]).sum()
        total = term if total is None else total + term
    return total


def _inputs(n, hdim, v, dtype, device, seed):
    gen = torch.Generator(device=device).manual_seed(seed)
    h = torch.randn(n, hdim, device=device, dtype=torch.float32, generator=gen).to(dtype).requires_grad_()
    w = (torch.randn(v, hdim, device=device, dtype=torch.float32, generator=gen) * WEIGHT_STD).to(dtype)
    w.requires_grad_()
    t = torch.randint(0, v, (n,), device=device, generator=gen)
    g = torch.rand(2, n, device=device, dtype=torch.float32, generator=gen) / n + 0.5 / n
    return h, w, t, g


def _reference(h, w, t, outputs, grad_outputs, temperature, g):
    """Float64 outputs and gradients of the bf16 inputs (upcast), TRL's definitions."""
    h64 = h.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_()
    out = torch_outputs(h64 @ w64.t(), t, outputs, temperature)
    _loss(out, grad_outputs, g.double()).backward()
    return {k: v.detach() for k, v in out.items()}, h64.grad, w64.grad


def check_peer(call, h_full, w, n_check, outputs, grad_outputs, temperature, seed):
    """The peer on the first n_check tokens against float64: {"rel_err": ..., "max_rel_err": ...}."""
    device = w.device
    h = h_full.detach()[:n_check].clone().requires_grad_()
    w.grad = None
    with torch.no_grad():
        z = h.double() @ w.detach().double().t()
    gen = torch.Generator(device=device).manual_seed(seed + 7)
    t = torch.randint(0, w.shape[0], (n_check,), device=device, generator=gen)
    t[::2] = z.argmax(-1)[::2]  # half the targets are the arg-max: is_top1 is neither all nor none
    del z
    g = torch.rand(2, n_check, device=device, dtype=torch.float32, generator=gen) / n_check + 0.5 / n_check
    ref, ref_gh, ref_gw = _reference(h, w, t, outputs, grad_outputs, temperature, g)
    out = call(h, w, t)
    _loss(out, grad_outputs, g).backward()
    rel, result = {}, {"tokens": n_check}
    pairs = [(k, out[k], ref[k]) for k in out if k != "is_top1"] + [("grad_hidden", h.grad, ref_gh),
                                                                     ("grad_weight", w.grad, ref_gw)]
    for name, got, want in pairs:
        if float(want.abs().max()) == 0.0:
            raise AssertionError(f"the float64 reference of {name} is all zeros; the check would prove nothing")
        rel[name] = bc.rel_err(got.float(), want)
    if "is_top1" in out:
        want = ref["is_top1"]
        if bool(want.all()) or not bool(want.any()):
            raise AssertionError("the float64 reference's is_top1 is all one value; the check would prove nothing")
        result["is_top1_mismatch"] = int((out["is_top1"].bool() != want).sum())
        result["is_top1_true"] = int(want.sum())
    result["rel_err"] = rel
    result["max_rel_err"] = max(rel.values())
    w.grad = None
    return result


def measure_peer(call, h, w, t, g, grad_outputs, device, max_ms, min_reps):
    leaves = [h, w]

    def step():
        _loss(call(h, w, t), grad_outputs, g).backward()

    for x in leaves:
        x.grad = None
    step()  # compile / warm
    for x in leaves:
        x.grad = None
    bc.free_memory(device)
    existing = bc.storages([h, w, t, g])
    extra, _ = bc.peak_extra_bytes(step, device, leaves, existing)
    grads = bc.new_grad_bytes(leaves, existing)
    ms = bc.bench_ms(step, device, grad_to_none=leaves, max_ms=max_ms, min_reps=min_reps)
    for x in leaves:
        x.grad = None
    return {"ms": ms, "peak_extra_bytes": extra, "peak_beyond_inputs_bytes": extra + grads if extra >= 0 else -1}


def run_row(case, hdim, v, set_name, n, dtype, device, peers, trl_fn, supported, vocab_chunk, n_check, max_ms,
            deadline, seed):
    outputs, grad_outputs, temperature = OUTPUT_SETS[set_name]
    row = {"case": case, "hidden": hdim, "vocab": v, "tokens": n, "dtype": str(dtype).replace("torch.", ""),
           "set": set_name, "outputs": list(outputs), "grad_outputs": list(grad_outputs),
           "temperature": temperature, "peers": {}}
    h, w, t, g = _inputs(n, hdim, v, dtype, device, seed)
    for peer in peers:
        res = row["peers"][peer] = {}
        if deadline.over(margin=10):
            res.update(status="skipped", error="budget spent")
            continue
        if peer == "trl":
            if trl_fn is None:
                res.update(status="unavailable", error="trl not importable (see the top-level 'trl')")
                continue

            def call(hh, ww, tt, _o=outputs, _T=temperature):
                return run_trl(trl_fn, hh, ww, tt, _o, _T, vocab_chunk)
            res["outputs_computed"], res["missing"] = list(outputs), []
        elif peer == "ours":
            if "entropy" in grad_outputs:
                res.update(status="unsupported", error="our fused linear cross entropy has no entropy gradient")
                continue

            def call(hh, ww, tt, _o=outputs, _T=temperature):
                return run_ours(hh, ww, tt, _o, _T, supported)
            have = ["log_probs"] + [o for o in outputs if o != "log_probs" and o in supported]
            res["outputs_computed"] = have
            res["missing"] = [o for o in outputs if o not in have]
        else:
            if device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(device)
                if torch_bytes(n, v) > 0.9 * free:
                    res.update(status="does_not_fit", error=f"needs ~{torch_bytes(n, v) / bc.GiB:.0f} GiB, "
                                                        f"{free / bc.GiB:.0f} GiB free")
                    continue

            def call(hh, ww, tt, _o=outputs, _T=temperature):
                return run_torch(hh, ww, tt, _o, _T)
            res["outputs_computed"], res["missing"] = list(outputs), []
        try:
            res.update(measure_peer(call, h, w, t, g, grad_outputs, device, max_ms, 3 if device.type == "cpu" else 10))
            res["check"] = check_peer(call, h, w, n_check, outputs, grad_outputs, temperature, seed)
            res["status"] = "ok"
            bad = [k for k, e in res["check"]["rel_err"].items() if not math.isfinite(e)]
            if bad:
                res.update(status="failed", error=f"non-finite results: {bad}")
        except torch.cuda.OutOfMemoryError as exc:
            res.update(status="does_not_fit", error=f"out of memory: {str(exc)[:300]}")
        except Exception as exc:  # noqa: BLE001 - recorded, the next peer runs
            res.update(status="failed", error=f"{type(exc).__name__}: {exc}",
                       traceback=traceback.format_exc()[-3000:])
        finally:
            h.grad = w.grad = None
            bc.free_memory(device)
    for other in ("trl", "torch"):
        ok = all(row["peers"].get(p, {}).get("status") == "ok" for p in (other, "ours"))
        row[f"{other}_ms_over_ours_ms"] = row["peers"][other]["ms"] / row["peers"]["ours"]["ms"] if ok else None
    del h, w, t, g
    bc.free_memory(device)
    return row


def _line(row) -> str:
    parts = [f"{row['case']:<12} {row['set']:<19}"]
    for peer, res in row["peers"].items():
        if res.get("status") == "ok":
            mib = res["peak_extra_bytes"] / bc.MiB if res["peak_extra_bytes"] >= 0 else float("nan")
            parts.append(f"{peer} {res['ms']:8.2f} ms {mib:7.0f} MiB err {res['check']['max_rel_err']:.1e}"
                         + (f" (missing {','.join(res['missing'])})" if res.get("missing") else ""))
        else:
            parts.append(f"{peer} {res.get('status')}: {res.get('error', '')[:80]}")
    if row.get("trl_ms_over_ours_ms"):
        parts.append(f"trl/ours {row['trl_ms_over_ours_ms']:.2f}x")
    return " | ".join(parts)


def summary(rows) -> list[dict]:
    """One flat line per row: each peer's ms and peak MiB beyond its inputs (None unless it ran)."""
    out = []
    for row in rows:
        line = {"case": row["case"], "set": row["set"], "trl_ms_over_ours_ms": row.get("trl_ms_over_ours_ms")}
        for peer, res in row["peers"].items():
            ok = res.get("status") == "ok"
            line[f"{peer}_ms"] = res["ms"] if ok else None
            line[f"{peer}_peak_extra_mib"] = res["peak_extra_bytes"] / bc.MiB if ok and res["peak_extra_bytes"] >= 0 \
                else None
            line[f"{peer}_max_rel_err"] = res["check"]["max_rel_err"] if ok else None
            if res.get("missing"):
                line[f"{peer}_missing"] = res["missing"]
        out.append(line)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="JSON output path")
    ap.add_argument("--budget-s", type=float, default=420.0, help="wall-clock budget (rows past it are skipped)")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU under TRITON_INTERPRET=1 (seconds)")
    ap.add_argument("--device", default=None, help="cuda (default) or cpu (only with --tiny)")
    ap.add_argument("--tokens", type=int, default=None, help="tokens per row (default 16384; 64 with --tiny)")
    ap.add_argument("--cases", default=None, help=f"comma list among {','.join(SHAPES)}")
    ap.add_argument("--sets", default=None, help=f"comma list among {','.join(OUTPUT_SETS)}")
    ap.add_argument("--peers", default=",".join(PEERS), help=f"comma list among {','.join(PEERS)}")
    ap.add_argument("--check-tokens", type=int, default=None, help="tokens of the float64 check (default 256; 24)")
    a = ap.parse_args(argv)

    t0 = time.monotonic()
    deadline = bc.Deadline(a.budget_s)
    device = torch.device(a.device or ("cpu" if a.tiny else "cuda"))
    data = {"args": vars(a), "rows": [], "status": "running",
            "timer": "triton.testing.do_bench median, GPU time (CUDA events)" if device.type == "cuda"
            else "perf_counter median (CPU dry run)"}
    if device.type == "cuda" and not torch.cuda.is_available():
        data["status"] = "failed: no CUDA device (for a CPU dry run: --tiny with TRITON_INTERPRET=1)"
        print(f"bench_trl_head: {data['status']}", file=sys.stderr)
        bc.write_json(a.out, data)
        return 3
    if device.type == "cpu" and not a.tiny:
        print("bench_trl_head: --device cpu only runs with --tiny (the Triton interpreter)", file=sys.stderr)
        return 3
    if device.type == "cuda" and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("bench_trl_head: TRITON_INTERPRET is on; set it to 0 to time real kernels", file=sys.stderr)
        return 3
    shapes = TINY_SHAPES if a.tiny else SHAPES
    cases = a.cases.split(",") if a.cases else list(shapes)
    sets = a.sets.split(",") if a.sets else list(OUTPUT_SETS)
    peers = a.peers.split(",")
    for name, values, known in (("--cases", cases, shapes), ("--sets", sets, OUTPUT_SETS), ("--peers", peers, PEERS)):
        unknown = [x for x in values if x not in known]
        if unknown:
            print(f"bench_trl_head: {name} {unknown} unknown; choose among {','.join(known)}", file=sys.stderr)
            return 3
    n = a.tokens or (64 if a.tiny else 16384)
    n_check = min(n, a.check_tokens or (24 if a.tiny else 256))
    dtype = torch.bfloat16
    try:
        data["environment"] = bc.environment(device)
        trl_fn, data["trl"] = load_trl()
        data["environment"]["trl"] = data["trl"]["version"]
        if trl_fn is None:
            print(f"bench_trl_head: TRL NOT MEASURED: {data['trl']['error']}", file=sys.stderr)
        elif not data["trl"]["backward_gather"].startswith("trl."):
            print(f"bench_trl_head: note: {data['trl']['backward_gather']}", file=sys.stderr)
        data["ours_stats"] = ours_stats_supported(device)
        print(f"bench_trl_head: {device}, {n} tokens, trl {data['trl']['version']}, ours' stats "
              f"{data['ours_stats']}", flush=True)
        bc.write_json(a.out, data)
        for i, case in enumerate(cases):
            hdim, v = shapes[case]
            for j, set_name in enumerate(sets):
                if deadline.over(margin=10):
                    data["status"] = "budget spent"
                    break
                row = run_row(case, hdim, v, set_name, n, dtype, device, peers, trl_fn, data["ours_stats"],
                              TINY_TRL_VOCAB_CHUNK if a.tiny else TRL_VOCAB_CHUNK, n_check,
                              200.0 if a.tiny else 1000.0, deadline, seed=1000 * i + j)
                data["rows"].append(row)
                print(_line(row), flush=True)
                data["wall_s"] = time.monotonic() - t0
                bc.write_json(a.out, data)
        if data["status"] == "running":
            data["status"] = "complete"
    except Exception as exc:  # noqa: BLE001 - recorded in the JSON, exit 2
        data["status"] = f"failed: {type(exc).__name__}: {exc}"
        data["traceback"] = traceback.format_exc()[-4000:]
        print(data["traceback"], file=sys.stderr)
    data["wall_s"] = time.monotonic() - t0
    data["summary"] = summary(data["rows"])
    bc.write_json(a.out, data)
    failed = [(r["case"], r["set"], p) for r in data["rows"] for p, res in r["peers"].items()
              if res.get("status") in ("failed", "skipped")]
    print(f"bench_trl_head: {data['status']}, {len(data['rows'])} rows, {time.monotonic() - t0:.0f} s"
          + (f"; failed or skipped: {failed}" if failed else ""), flush=True)
    if data["status"] != "complete" or failed:
        return 2
    if "trl" in peers and trl_fn is None:
        print(f"bench_trl_head: TRL NOT MEASURED: {data['trl']['error']}", file=sys.stderr)
        return 4
    return 0


if __name__ == "__main__":
    sys.exit(main())
