"""Expert-parallel token exchange, uneven against padded (issue 23 item 2), on 2 gloo CPU ranks.

One routed-expert layer (`models.moe.routed_experts`: sort by expert, dispatch, SwiGLU
grouped GEMM, combine, gate, scatter back) forward and backward, compiled with
fullgraph=True, on ep 2 (each rank holds half the experts), with two exchanges:

  uneven   meshtrain's `parallel.expert_parallel.AllToAllExchange`: the per-expert counts
           are exchanged first, the split sizes read from them (unbacked sizes inside the
           graph), and exactly the routed rows travel and are computed
  padded   a fixed-capacity exchange that stays dropless by construction: each rank sends
           every peer a block of `cap` = all its routed rows (the most one peer can get),
           so every shape is static and nothing is read from the counts; the receiver
           sorts the valid rows by expert and hands the padding to its last expert
           (computed, then dropped)

Both must give the same output and the same input and weight gradients (rtol 1e-5) on
every rank, or nothing is timed. Then --rounds rounds of --steps calls of each, in
alternating order between barriers; a round's time is the slowest rank's. Reported:
median ms per forward + backward, padded / uneven, the rows each sends and computes.

    python bench/moe_exchange_cpu.py --json out.json          # 4096 tokens, dim 256, 8 experts top 2
    python bench/moe_exchange_cpu.py --tiny --json out.json   # CI-sized (aot_eager)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from meshtrain.models.moe import MoeConfig, routed_experts, route  # noqa: E402
from meshtrain.parallel.expert_parallel import AllToAllExchange  # noqa: E402
from meshtrain.testing import run_ranks  # noqa: E402
from rank_rounds import alternating_rounds, on_every_rank  # noqa: E402

RTOL = 1e-5
FULL = dict(tokens=4096, dim=256, ffn=512, experts=8, top_k=2)
TINY = dict(tokens=64, dim=32, ffn=48, experts=4, top_k=2)


class PaddedExchange:
    """The `models.moe.Exchange` protocol with static shapes: `cap` rows per (source,
    destination) pair, cap = the rows a rank routes (dropless whatever the routing)."""

    def __init__(self, group, ep: int, num_experts: int):
        self.group, self.ep, self.local_experts = group, ep, num_experts // ep

    def dispatch(self, rows: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n, ep, le = rows.shape[0], self.ep, self.local_experts
        self.cap = cap = n
        per_dest = counts.view(ep, le).sum(1)
        dest = torch.arange(ep, device=rows.device).repeat_interleave(per_dest, output_size=n)
        start = per_dest.cumsum(0) - per_dest
        self.pos = dest * cap + torch.arange(n, device=rows.device) - start[dest]  # row -> send slot
        send = rows.new_zeros(ep * cap, rows.shape[1]).index_copy(0, self.pos, rows)
        received = funcol.all_to_all_single(counts, None, None, self.group).view(ep, le)
        arrived = funcol.all_to_all_single_autograd(send, [cap] * ep, [cap] * ep, self.group)
        # Slot j of source s holds local expert e where j falls in that source's e-th run,
        # padding (le) past its valid rows; sorting by that key groups rows by expert.
        ends = received.cumsum(1)
        slot = torch.arange(cap, device=rows.device).expand(ep, cap).contiguous()
        key = torch.searchsorted(ends, slot, right=True)
        self.order = key.flatten().argsort(stable=True)
        local = received.sum(0)
        local = torch.cat([local[:-1], local[-1:] + (ep * cap - local.sum())])  # padding: the last expert's
        return arrived[self.order], local

    def combine(self, rows: torch.Tensor) -> torch.Tensor:
        back = rows[self.order.argsort()]
        returned = funcol.all_to_all_single_autograd(back, [self.cap] * self.ep, [self.cap] * self.ep, self.group)
        return returned[self.pos]


def rank_main(shape: dict, backend, steps: int, rounds: int) -> dict:
    torch.set_num_threads(1)
    rank, ep = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    cfg = MoeConfig(num_experts=shape["experts"], top_k=shape["top_k"], expert_ffn_dim=shape["ffn"])
    g = torch.Generator().manual_seed(1000 + rank)  # each rank its own tokens and routing
    d, f, le = shape["dim"], shape["ffn"], shape["experts"] // ep
    x = torch.randn(shape["tokens"], d, generator=g)
    idx, gates, _ = route(torch.randn(shape["tokens"], shape["experts"], generator=g) * 2, cfg)
    w = torch.Generator().manual_seed(7)  # the whole expert weights, this rank's slice
    weights = [t[rank * le:(rank + 1) * le].clone().requires_grad_()
               for t in (torch.randn(cfg.num_experts, f, d, generator=w) * d ** -0.5,
                         torch.randn(cfg.num_experts, f, d, generator=w) * d ** -0.5,
                         torch.randn(cfg.num_experts, d, f, generator=w) * f ** -0.5)]
    x.requires_grad_()
    exchanges = {"uneven": AllToAllExchange(group, ep, cfg.num_experts), "padded": PaddedExchange(group, ep, cfg.num_experts)}

    def make(exchange):
        def layer(x, w_gate, w_up, w_down):
            return routed_experts(x, idx, gates, w_gate, w_up, w_down, cfg, exchange)
        return torch.compile(layer, fullgraph=True, dynamic=False, backend=backend)

    fns = {name: make(ex) for name, ex in exchanges.items()}

    def call(name):
        for t in (x, *weights):
            t.grad = None
        out = fns[name](x, *weights)
        out.square().sum().backward()
        return out.detach(), [t.grad.clone() for t in (x, *weights)]

    out = {"first_call_s": {}}
    results = {}
    for name in fns:
        dist.barrier()
        t0 = time.perf_counter()
        results[name] = call(name)
        out["first_call_s"][name] = time.perf_counter() - t0
    (y_u, g_u), (y_p, g_p) = results["uneven"], results["padded"]
    agree = torch.allclose(y_p, y_u, rtol=RTOL, atol=1e-6) and all(
        torch.allclose(a, b, rtol=RTOL, atol=1e-6) for a, b in zip(g_p, g_u))
    out["passed"] = on_every_rank(agree)
    routed = shape["tokens"] * shape["top_k"]  # rows this rank sends, to itself included
    per_dest = torch.bincount(idx.flatten(), minlength=cfg.num_experts).view(ep, le).sum(1)
    computed = torch.empty_like(per_dest)
    dist.all_to_all_single(computed, per_dest)
    out["rows"] = {"uneven_sent": routed, "uneven_computed": int(computed.sum()),
                   "padded_sent": ep * routed, "padded_computed": ep * routed}
    if out["passed"]:
        out["round_s"] = alternating_rounds(call, ("uneven", "padded"), rounds, steps)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="CI-sized shapes, aot_eager unless --backend")
    p.add_argument("--backend", default=None, help="torch.compile backend (default inductor; --tiny: aot_eager)")
    p.add_argument("--steps", type=int, default=None, help="calls per exchange per round (default 5; --tiny 1)")
    p.add_argument("--rounds", type=int, default=None, help="rounds (default 5; --tiny 2)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    shape = TINY if args.tiny else FULL
    backend = args.backend or ("aot_eager" if args.tiny else "inductor")
    steps = args.steps or (1 if args.tiny else 5)
    rounds = args.rounds or (2 if args.tiny else 5)
    r = run_ranks(rank_main, 2, shape, backend, steps, rounds,
                  start="spawn" if backend == "inductor" else "forkserver")[0]
    report = {"torch": torch.__version__, "cores": os.cpu_count(), "tiny": args.tiny, "backend": backend,
              "layout": "ep2 (2 ranks)", "shape": shape, "passed": r["passed"], "rows": r["rows"],
              "first_call_s": r["first_call_s"]}
    if not r["passed"]:
        print(f"padded and uneven exchanges disagree (rtol {RTOL}); nothing timed")
        return 1
    ms = {n: 1e3 * statistics.median(v) / steps for n, v in r["round_s"].items()}
    report.update(ms_per_call=ms, padded_over_uneven=ms["padded"] / ms["uneven"],
                  round_ms={n: [1e3 * t / steps for t in v] for n, v in r["round_s"].items()})
    rows = r["rows"]
    print(f"ep2, {backend}, rank 0: uneven {ms['uneven']:.1f} ms, padded {ms['padded']:.1f} ms per forward + "
          f"backward, padded / uneven {report['padded_over_uneven']:.2f}x (rows sent {rows['uneven_sent']:.0f} "
          f"vs {rows['padded_sent']:.0f}, computed {rows['uneven_computed']:.0f} vs {rows['padded_computed']:.0f})")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
