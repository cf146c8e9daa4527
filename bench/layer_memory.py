"""Bytes a transformer layer keeps for backward, measured by the allocator, against the
textbook constant and the planner (issue 25; docs/plan.md "Activation memory per layer").

For each family (llama, gpt2), activation checkpointing mode (none, selective, full),
precision (fp32, bf16), shape (micro-batch b x sequence s) and layout (one process, tp2
with sequence parallelism on two gloo ranks), one forward is run under torch.profiler
with the models at L and L + 1 layers (tp2: rank 0 of two on the fake process group, whose
collectives run on the calling thread: the same shapes and collectives, in one process); the bytes the forward allocated and still holds
when it returns (`meshtrain.train.peak_memory.held_cpu_bytes`: what autograd keeps for
backward, plus the outputs) differ by what one layer keeps. Reported per row:

  measured   bytes per layer (the difference), on one rank (every tp rank holds the same)
  planner    the same difference of `meshtrain plan`'s activations (estimate/memory.py)
  textbook   the constant docs/plan.md derives for the mode, in bytes per layer
  ratios     planner / measured and textbook / measured (1.000: equal)

The parameters are created before the forward and not counted; under bf16 a layer's
weights are cast per use, and the copies its matmuls keep are part of the layer (the
planner's saved weights, the textbook's term w).

    python bench/layer_memory.py --json layer_memory.json
    python bench/layer_memory.py --tiny --json out.json   # seconds, for CI
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from meshtrain import MeshSpec, Rules, build, init_params, make_plan  # noqa: E402
from meshtrain.estimate.memory import per_rank_memory  # noqa: E402
from meshtrain.models import gpt2, llama  # noqa: E402
from meshtrain.models.policy import Policy  # noqa: E402
from meshtrain.train.peak_memory import held_cpu_bytes  # noqa: E402

MODES = ("none", "selective", "full")
PRECISIONS = ("fp32", "bf16")
FAMILIES = {
    "llama": lambda n: llama.LlamaConfig(dim=128, n_layers=n, n_heads=8, n_kv_heads=2, ffn_dim=352, vocab_size=256,
                                         max_seq_len=1024),
    "gpt2": lambda n: gpt2.GPT2Config(dim=128, n_layers=n, n_heads=8, ffn_dim=512, vocab_size=256, max_seq_len=1024),
}
SHAPES = {"default": [(1, 256), (2, 512), (1, 1024)], "tiny": [(2, 64)]}
LAYERS = 2  # the models compared have LAYERS and LAYERS + 1 layers


def _model(family: str, n: int):
    return build(family, FAMILIES[family](n))


def _plan(model, tp: int):
    if tp == 1:
        return None
    return make_plan(model.specs, Rules.default(sp=True), MeshSpec(tp=tp), world=tp)


def _held(family: str, n: int, mode: str, precision: str, b: int, s: int, tp: int) -> int:
    """Bytes one forward of the n-layer model keeps, on this rank."""
    from meshtrain.models.context import LocalContext
    from meshtrain.models.spec import init_slice
    from meshtrain.parallel.context import ShardedContext

    model = _model(family, n)
    policy = Policy.of(precision, activation_checkpointing=mode)
    plan = _plan(model, tp)
    if plan is None:
        params = {k: init_slice(spec, k, seed=0).requires_grad_() for k, spec in model.specs.items()}
        ctx = LocalContext(policy)
    else:
        mesh = plan.mesh.build()
        params = init_params(plan, mesh, seed=0)
        ctx = ShardedContext(plan, mesh, policy)
    tokens = torch.randint(0, model.cfg.vocab_size, (b, s), generator=torch.Generator().manual_seed(0))

    def forward():
        scope = getattr(ctx, "regather_in_backward", None)
        with scope() if scope else torch.enable_grad():
            loss = ctx.cross_entropy_sum(model.forward(params, tokens, ctx), tokens)
        gc.collect()  # what only a reference cycle holds is not kept for backward
        return loss

    loss, held = held_cpu_bytes(forward)
    loss.backward()  # the saved tensors are used: nothing was kept for show
    return held


def _measure_all(cases, tp: int):
    """Bytes held per case; tp > 1 on the fake process group (rank 0 of tp): shapes and
    collectives as on real ranks, run on this thread (held_cpu_bytes needs that), values
    not (no peer answers), which the bytes do not depend on."""
    if tp == 1:
        return {case: _held(*case) for case in cases}
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=tp)
    try:
        return {case: _held(*case) for case in cases}
    finally:
        dist.destroy_process_group()


def planner_per_layer(family: str, mode: str, precision: str, b: int, s: int, tp: int) -> int:
    out = []
    for n in (LAYERS, LAYERS + 1):
        model = _model(family, n)
        plan = _plan(model, tp) or make_plan(model.specs, Rules.default(), MeshSpec(), world=1)
        est = per_rank_memory(plan, model, micro_batch=b, seq_len=s, precision=precision,
                              activation_checkpointing=mode, attention="flash")
        out.append(est["activations"])
    return out[1] - out[0]


def textbook_per_layer(family: str, mode: str, precision: str, b: int, s: int, tp: int) -> int:
    """docs/plan.md's per-layer constants, term by term (T tokens on this rank's sequence
    shard under sp: every term divided by tp)."""
    cfg = FAMILIES[family](1)
    c = 2 if precision == "bf16" else 4
    D, F, Hq = cfg.dim, cfg.ffn_dim, cfg.n_heads
    g = (cfg.n_kv_heads if family == "llama" else Hq) / Hq
    stats = 1 if family == "llama" else 2  # fp32 per token per norm: rsqrt (+ mean)
    swiglu = family == "llama"
    T = b * s / tp
    # Weights the layer's matmuls and norms keep as bf16 copies (fp32: the parameters
    # themselves; checkpointed: cast again in the recompute).
    weights = c * (D * D * (2 + 2 * g) + (3 if swiglu else 2) * D * F) / tp + c * 2 * D if c == 2 else 0
    if mode == "none":
        per_token = c * ((6 + 2 * g) * D + (4 if swiglu else 2) * F) + 2 * 4 * stats + 4 * Hq
        return round(T * per_token + weights)
    if mode == "full":
        return round(T * c * D)
    # selective: the layer input, and the outputs of the matmuls and the attention
    # kernel: q, k, v, the attention output and log-sum-exp, wo's and w_down's outputs
    # (reduced over tp: a sequence shard), the MLP's up (and gate) projection.
    per_token = c * ((5 + 2 * g) * D + (2 if swiglu else 1) * F) + 4 * Hq
    return round(T * per_token)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="one shape, for CI")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    shapes = SHAPES["tiny" if args.tiny else "default"]
    keys = [(f, m, p, b, s) for f in FAMILIES for m in MODES for p in PRECISIONS for b, s in shapes]
    rows = []
    for tp in (1, 2):
        held = _measure_all([(f, n, m, p, b, s, tp) for f, m, p, b, s in keys for n in (LAYERS, LAYERS + 1)], tp)
        for f, m, p, b, s in keys:
            measured = held[(f, LAYERS + 1, m, p, b, s, tp)] - held[(f, LAYERS, m, p, b, s, tp)]
            planner = planner_per_layer(f, m, p, b, s, tp)
            textbook = textbook_per_layer(f, m, p, b, s, tp)
            rows.append({"family": f, "mode": m, "precision": p, "micro_batch": b, "seq": s, "tp": tp,
                         "measured": measured, "planner": planner, "textbook": textbook,
                         "planner_ratio": planner / measured, "textbook_ratio": textbook / measured})
    print(f"{'family':<6} {'mode':<9} {'prec':<4} {'b x s':>7} {'tp':>2} {'measured KiB':>12} "
          f"{'planner':>8} {'textbook':>8}")
    for r in rows:
        print(f"{r['family']:<6} {r['mode']:<9} {r['precision']:<4} {r['micro_batch']:>2} x{r['seq']:>4} {r['tp']:>2} "
              f"{r['measured'] / 1024:12.1f} {r['planner_ratio']:8.3f} {r['textbook_ratio']:8.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "command": "python " + " ".join(sys.argv),
                       "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cpus, torch "
                                  f"{torch.__version__}",
                       "date": datetime.date.today().isoformat()}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
