"""Mixture-of-experts compute: the grouped expert SwiGLU against a per-expert loop, and the
whole routed MoE feed-forward against a dense MLP of the same active FLOPs per token.

Forward + backward (gradients of the inputs and of every weight, via torch.autograd.grad),
on the default device (CUDA in bf16 when there is one, else CPU in fp32). Per case:

  ratio      loop ms / grouped ms. grouped: `expert_swiglu` (meshtrain/models/experts.py:
             torch._grouped_mm where `_grouped_mm_ok` holds, else its own per-expert loop
             inside custom ops) on rows already sorted by expert. loop: the reference,
             written here: the same SwiGLU per expert in a Python loop of plain torch ops
             (weights unbound once, so their gradient is one stack). Above 1: grouped wins.
  overhead   MoE ms / dense ms. MoE: router matmul + `route` + `routed_experts` (dropless:
             sort, gather, experts, gate, scatter-add). dense: a SwiGLU MLP with hidden
             top_k x expert_ffn, the same matmul FLOPs per token. 1.0: routing is free.

Routing is skewed: token t picks its top_k experts without replacement with probability
proportional to (e+1)^-0.7 over experts 0..E-3 (Zipf, --skew), and the last two experts
get no token (the busiest gets ~2.3x the mean at 8 experts, ~7x at 64). The router logits
are log p plus fixed Gumbel noise (so top-k samples p) plus a small trainable router
matmul, so gradients flow through the gates.
Each round runs every variant once, in alternating order, after warm-up; reported is the
median over rounds. Everything shares the process, inputs and weights.

    python bench/moe.py --json moe.json      # CPU: ~45 s on 2 cores; CUDA: bf16, bigger shapes
    python bench/moe.py --tiny --json out.json   # CPU, seconds
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from meshtrain.models.experts import _grouped_mm_ok, expert_swiglu, sort_by_expert  # noqa: E402
from meshtrain.models.moe import MoeConfig, route, routed_experts  # noqa: E402

EMPTY = 2  # experts that get no token


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _rounds(fns, device, warmup, rounds):
    """Seconds of each call of each closure in `fns` (name -> fn), per round: `warmup`
    untimed calls each, then `rounds` rounds that call every closure once, in alternating
    order (a load that comes and goes then hits all of them alike)."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    _sync(device)
    times = {name: [] for name in fns}
    names = list(fns)
    for i in range(rounds):
        for name in (names if i % 2 == 0 else names[::-1]):
            t = time.perf_counter()
            fns[name]()
            _sync(device)
            times[name].append(time.perf_counter() - t)
    return times


def loop_swiglu(x, w_gate, w_up, w_down, counts):
    """The reference: each expert's SwiGLU on its rows, one Python iteration per expert."""
    outs = []
    for rows, wg, wu, wd in zip(x.split(counts.tolist()), w_gate.unbind(0), w_up.unbind(0), w_down.unbind(0)):
        outs.append((F.silu(rows @ wg.T) * (rows @ wu.T)) @ wd.T)
    return torch.cat(outs)


def dense_swiglu(x, w_gate, w_up, w_down):
    return (F.silu(x @ w_gate.T) * (x @ w_up.T)) @ w_down.T


def skew_logits(tokens, experts, skew, generator, device):
    """log p + Gumbel noise (tokens, E), fp32: top-k of it draws k distinct experts with
    probability p, p_e ~ (e+1)^-skew for e < E - EMPTY and 0 for the last EMPTY experts."""
    live = experts - EMPTY
    logp = torch.full((experts,), -1e4)
    logp[:live] = -skew * torch.log(torch.arange(1, live + 1, dtype=torch.float32))
    u = torch.rand(tokens, experts, generator=generator).clamp_(1e-9, 1 - 1e-9)
    return (logp - torch.log(-torch.log(u))).to(device)


def measure_case(device, dtype, tokens, dim, experts, top_k, expert_ffn, skew, warmup, rounds, seed=0):
    if experts < top_k + EMPTY:
        raise SystemExit(f"--experts {experts}: needs at least top_k + {EMPTY} = {top_k + EMPTY}")
    g = torch.Generator().manual_seed(seed)

    def randn(*shape, std=1.0):
        return (torch.randn(*shape, generator=g) * std).to(device=device, dtype=dtype).requires_grad_()

    cfg = MoeConfig(num_experts=experts, top_k=top_k, expert_ffn_dim=expert_ffn)
    x = randn(tokens, dim)
    w_router = randn(experts, dim, std=1e-2 / dim ** 0.5)  # tiny: the skew decides the routing
    w_gate, w_up = randn(experts, expert_ffn, dim, std=dim ** -0.5), randn(experts, expert_ffn, dim, std=dim ** -0.5)
    w_down = randn(experts, dim, expert_ffn, std=expert_ffn ** -0.5)
    hidden = top_k * expert_ffn
    d_gate, d_up = randn(hidden, dim, std=dim ** -0.5), randn(hidden, dim, std=dim ** -0.5)
    d_down = randn(dim, hidden, std=hidden ** -0.5)
    skew = skew_logits(tokens, experts, skew, g, device)
    dout = torch.randn(tokens, dim, generator=g).to(device=device, dtype=dtype)

    def logits():
        return (x @ w_router.T).float() + skew

    with torch.no_grad():
        idx, _, _ = route(logits(), cfg)
        order, counts = sort_by_expert(idx, experts)
        rows = x[order // top_k].detach().requires_grad_()
    drows = torch.randn(rows.shape, generator=g).to(device=device, dtype=dtype)
    experts_w = (w_gate, w_up, w_down)

    def grouped():
        torch.autograd.grad(expert_swiglu(rows, *experts_w, counts), (rows, *experts_w), drows)

    def loop():
        torch.autograd.grad(loop_swiglu(rows, *experts_w, counts), (rows, *experts_w), drows)

    def moe():
        i, gates, _ = route(logits(), cfg)
        out = routed_experts(x, i, gates, *experts_w, cfg)
        torch.autograd.grad(out, (x, w_router, *experts_w), dout)

    def dense():
        torch.autograd.grad(dense_swiglu(x, d_gate, d_up, d_down), (x, d_gate, d_up, d_down), dout)

    # Same numbers before timing: the gradients of grouped and loop, relative to their norm.
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for name, a, b in zip(("x", "w_gate", "w_up", "w_down"),
                          torch.autograd.grad(expert_swiglu(rows, *experts_w, counts), (rows, *experts_w), drows),
                          torch.autograd.grad(loop_swiglu(rows, *experts_w, counts), (rows, *experts_w), drows)):
        err = ((a.float() - b.float()).norm() / b.float().norm()).item()
        if not err <= tol:
            raise SystemExit(f"grouped and loop disagree on d{name}: relative error {err:.2e} > {tol}")

    grouped_path = _grouped_mm_ok(rows, w_gate) and _grouped_mm_ok(rows, w_down)  # the hidden has rows' dtype
    times = _rounds(dict(grouped=grouped, loop=loop, moe=moe, dense=dense), device, warmup, rounds)
    ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    load = counts.float()
    return {"name": f"e{experts}k{top_k}", "tokens": tokens, "dim": dim, "experts": experts, "top_k": top_k,
            "expert_ffn": expert_ffn, "grouped_path": grouped_path,
            "grouped_ms": ms["grouped"], "loop_ms": ms["loop"], "ratio": ms["loop"] / ms["grouped"],
            "moe_ms": ms["moe"], "dense_ms": ms["dense"], "overhead": ms["moe"] / ms["dense"],
            "load_max_over_mean": (load.max() / load.mean()).item(), "empty_experts": int((counts == 0).sum()),
            "rounds_ms": {k: [round(t * 1e3, 2) for t in v] for k, v in times.items()}}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="small shapes on the CPU, for CI")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--device", help="default: cuda if available, else cpu")
    ap.add_argument("--tokens", type=int)
    ap.add_argument("--dim", type=int)
    ap.add_argument("--experts", type=int, nargs="+")
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--expert-ffn", type=int)
    ap.add_argument("--skew", type=float, default=0.7, help="Zipf exponent of the routing (0: uniform)")
    ap.add_argument("--warmup", type=int)
    ap.add_argument("--rounds", type=int)
    ap.add_argument("--threads", type=int, help="intra-op threads (default: torch's)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() and not args.tiny else "cpu"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.tiny:
        shape, experts, warmup, rounds = dict(tokens=256, dim=64, expert_ffn=128), [8, 16], 1, 3
    elif device.type == "cuda":
        shape, experts, warmup, rounds = dict(tokens=16384, dim=2048, expert_ffn=1408), [8, 64], 3, 20
    else:
        shape, experts, warmup, rounds = dict(tokens=2048, dim=512, expert_ffn=1024), [8, 64], 1, 7
    shape.update({k: v for k, v in dict(tokens=args.tokens, dim=args.dim, expert_ffn=args.expert_ffn).items()
                  if v is not None})
    experts = args.experts or experts
    warmup = warmup if args.warmup is None else args.warmup
    rounds = args.rounds or rounds
    load = os.getloadavg()[0]
    cases = [measure_case(device, dtype, experts=e, top_k=args.top_k, skew=args.skew, warmup=warmup, rounds=rounds,
                          **shape) for e in experts]
    result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "dtype": str(dtype).removeprefix("torch."), "torch": torch.__version__,
              "threads": torch.get_num_threads(), "warmup": warmup, "rounds": rounds, "skew": args.skew,
              "loadavg_1min": [load, os.getloadavg()[0]],
              "grouped_path_rule": "meshtrain.models.experts._grouped_mm_ok", "cases": cases}
    print(f"{result['device']}, torch {result['torch']}, {result['dtype']}, {result['threads']} threads, "
          f"fwd+bwd, median of {rounds} rounds after {warmup} warm-up, load average {load:.2f} -> "
          f"{result['loadavg_1min'][1]:.2f}")
    print(f"{'case':<8} {'tokens':>6} {'dim':>5} {'E':>3} {'k':>2} {'ffn':>5} {'max/mean':>8} {'empty':>5} "
          f"{'grouped?':>8} {'grouped ms':>10} {'loop ms':>9} {'ratio':>6} {'moe ms':>9} {'dense ms':>9} "
          f"{'overhead':>8}")
    for c in cases:
        print(f"{c['name']:<8} {c['tokens']:>6} {c['dim']:>5} {c['experts']:>3} {c['top_k']:>2} "
              f"{c['expert_ffn']:>5} {c['load_max_over_mean']:>8.2f} {c['empty_experts']:>5} "
              f"{'yes' if c['grouped_path'] else 'no':>8} {c['grouped_ms']:>10.2f} {c['loop_ms']:>9.2f} "
              f"{c['ratio']:>6.2f} {c['moe_ms']:>9.2f} {c['dense_ms']:>9.2f} {c['overhead']:>8.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
