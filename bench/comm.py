"""Collective bytes of one training step, per layout, against the analytic minimum.

For each layout below, ONE real `make_train_step` step of a small Llama (fp32, untied
embeddings, eager) runs in this process on torch's fake process group (one process plays
rank 0 of a larger world: every collective is issued with its real shape, no data moves),
under a TorchDispatchMode (bench/comm_record.py) that records every collective: functional (DTensor) ones and the
plain c10d calls of context-parallel attention and expert parallelism. The minimum is
computed here from the model config alone, from first principles, without
meshtrain.estimate.comms (whose estimate tests/test_comms_estimate.py checks against the
runtime): a second opinion.

    ratio = measured bytes / analytic minimum      (>= 1; 1.0: no byte beyond the minimum)

Bytes are per rank per step, machine independent (no time is measured). The convention,
applied to both sides, is the bytes a rank SENDS under the ring (bandwidth-optimal)
algorithm, for a group of n ranks:

    all-reduce of X bytes                   2 (n-1)/n X
    all-gather to X bytes (the full output) (n-1)/n X
    reduce-scatter of X bytes (the input)   (n-1)/n X
    all-to-all of X bytes (the input)       (n-1)/n X   (the share for the rank itself stays)
    send of X bytes                         X           (a receive: 0, its sender counts it)

Scalar collectives (one element: the loss summed over the batch shards, the squared
gradient norm for clipping, the MoE aux-loss value) are left out of both sides and
reported apart (`scalar_bytes`): a few bytes that no layout can avoid nor make smaller.

The minimum per layout (b = 4 bytes: fp32; P_t = parameter elements one rank computes
with, i.e. the norms whole and every other matrix / tp; L layers, d dim, V vocab, T = the
tokens of one rank's batch shard, B x S / (dp x fsdp x cp)):

  dp       gradients all-reduced once: ar(dp) P_t b.
  fsdp     ZeRO-3 with resharding after forward (what the eager step does to save memory):
  (and cp) every parameter all-gathered in forward, all-gathered again in backward except
           the untied embedding table (the backward of a lookup needs no table value),
           gradients reduce-scattered once: ag (2 P_t - V d / tp) b + rs P_t b. So the
           minimum is (n-1)/n (3 P - V d) b, not 3 (n-1)/n P b; without resharding it would
           be (n-1)/n 2 P b. cp ranks hold the same weights and see other tokens, so they
           shard the weights too (the ZeRO-3 group is fsdp x cp).
  hsdp     the fsdp terms, then the gradient shard all-reduced over dp: ar(dp) P_t / fsdp b.
  tp       Megatron: per pass 2L + 1 activation all-reduces of T d b (forward: after the
           attention output and the MLP down projection of each block, and after the
           vocab-parallel embedding; backward: before q/k/v, before gate/up, before the
           vocab-parallel output projection), and the vocab-parallel cross entropy: three
           all-reduces of T fp32 (row max, sum of exponentials, target logit).
  tp + sp  each all-reduce becomes an all-gather and a reduce-scatter of the same total
           bytes (here with the gathered input kept for the weight gradient; the step
           keeps its sequence shard instead and gathers it again in backward, as
           Megatron does: a known excess of (2L + 1) ag(tp) T d b that divides the
           layer's activation memory by tp);
           the 2L + 1 norm weights now see a sequence shard, so their gradients are
           all-reduced over tp (as the fsdp shard: ar(tp) (2L + 1) d / fsdp b).
  cp       the fsdp x cp ZeRO-3 terms, and per layer K and V of the local batch rows and
           the whole sequence all-gathered in forward, their gradients reduce-scattered in
           backward: 2 L (cp-1)/cp KV b, KV = 2 x rows x S x kv_heads/tp x head_dim. The
           same for cp_comm ring (the same information, point to point). A causal-aware
           exchange could skip the chunks no query of the receiver sees (zigzag: 3/4 of
           this); the minimum here is the algorithm's, every rank gets the whole K/V.
  ep       (MoE, ep folded from fsdp) per MoE layer the routed rows out and back, forward
           and backward: 4 a2a(ep) T top_k d b; the per-expert counts: a2a(ep) 8 E; once
           per step the expert load (MoE layers x E, fp32) all-reduced over the data ranks
           (the step reports the imbalance; aux-free balancing needs it). Expert weights
           are sharded by expert (nothing gathered, each rank's expert gradients are
           whole); the other weights (router included) have the fsdp terms.

On the fake group no peer answers: for the MoE layout the per-expert counts all-to-all is
answered with this rank's own counts (every peer routes as this rank does), so the row
all-to-alls are sized as a balanced exchange. All-to-all bytes are counted with the
convention above on both sides ((ep-1)/ep of the input leaves); the real share depends on
the routing.

The step moves parameters in buckets (`--bucket`, make_train_step's and parallel.bucket's:
block, the default, one collective per block per mesh group; param, one per parameter,
the baseline the buckets were measured against; or a size in MB). Bytes are the same for
every unit; the number of calls is what changes.

    python bench/comm.py --json out.json       # dim 256, 4 layers, 8 x 256 tokens (1-2 min on 2 cores)
    python bench/comm.py --tiny --json out.json   # dim 32, 2 layers, 4 x 8 tokens (~10 s on 2 cores)
    python bench/comm.py --bucket param --json out.json   # the per-parameter baseline
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import sys
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from fractions import Fraction

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from comm_record import record_step, ring_bytes  # noqa: E402
from meshtrain.models import build  # noqa: E402
from meshtrain.models.llama import LlamaConfig  # noqa: E402
from meshtrain.models.moe import MoeConfig  # noqa: E402
from meshtrain.layout.traffic import check_bucket  # noqa: E402

FP32, INT64 = 4, 8


@dataclass(frozen=True)
class Layout:
    name: str
    mesh: dict
    sp: bool = False
    cp_comm: str = "allgather"
    moe: bool = False

    @property
    def world(self) -> int:
        return math.prod(v for k, v in self.mesh.items() if k != "ep")

    def size(self, axis: str) -> int:
        return self.mesh.get(axis, 1)


LAYOUTS = [
    Layout("dp2", dict(dp=2)),
    Layout("fsdp2", dict(fsdp=2)),
    Layout("tp2", dict(tp=2)),
    Layout("tp2-sp", dict(tp=2), sp=True),
    Layout("cp2-allgather", dict(cp=2)),
    Layout("cp2-ring", dict(cp=2), cp_comm="ring"),
    Layout("hsdp-dp2xfsdp2", dict(dp=2, fsdp=2)),
    Layout("fsdp2xtp2-sp", dict(fsdp=2, tp=2), sp=True),
    Layout("moe-fsdp2-ep2", dict(fsdp=2, ep=2), moe=True),
]

SIZES = {  # model, MoE experts (for the moe layouts), batch rows, sequence length
    "full": (LlamaConfig(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=688, vocab_size=512,
                         max_seq_len=256), MoeConfig(num_experts=8, top_k=2, expert_ffn_dim=128), 8, 256),
    "tiny": (LlamaConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=64, max_seq_len=8),
             MoeConfig(num_experts=4, top_k=2, expert_ffn_dim=16), 4, 8),
}


def model_config(cfg: LlamaConfig, moe: MoeConfig, layout: Layout) -> LlamaConfig:
    return LlamaConfig(**{**cfg.__dict__, "moe": moe if layout.moe else None})


# ---------------------------------------------------------------------------- minimum

def parameter_count(cfg: LlamaConfig) -> int:
    """All parameter elements, from the config (checked against the model's specs)."""
    return tp_local_elements(cfg, 1) + expert_elements(cfg)


def tp_local_elements(cfg: LlamaConfig, tp: int) -> int:
    """Elements of the non-expert parameters one tp rank computes with: norms and the
    router whole, every other matrix split tp ways (heads, mlp or vocab)."""
    d, hd, L, V = cfg.dim, cfg.dim // cfg.n_heads, cfg.n_layers, cfg.vocab_size
    attention = 2 * d * d + 2 * cfg.n_kv_heads * hd * d  # wq, wo; wk, wv
    moe_layers = len(cfg.moe_layers)
    mlp = (L - moe_layers) * 3 * cfg.ffn_dim * d
    router = moe_layers * cfg.moe.num_experts * d if moe_layers else 0
    norms = (2 * L + 1) * d
    return norms + router + (L * attention + mlp + 2 * V * d) // tp


def expert_elements(cfg: LlamaConfig) -> int:
    m = cfg.moe
    return len(cfg.moe_layers) * m.num_experts * 3 * m.expert_ffn_dim * cfg.dim if m else 0


def analytic_minimum(cfg: LlamaConfig, layout: Layout, batch: int, seq: int) -> dict[str, Fraction]:
    """Named terms of the minimum bytes one rank sends per step (module docstring)."""
    if cfg.tie_embeddings:
        raise ValueError("the minimum is written for untied embeddings")
    dp, fsdp, cp, tp, ep = (layout.size(a) for a in ("dp", "fsdp", "cp", "tp", "ep"))
    d, L, V, b = cfg.dim, cfg.n_layers, cfg.vocab_size, FP32
    shard = fsdp * cp  # the ZeRO-3 group
    rows = batch // (dp * fsdp)  # sequences of one rank's batch shard
    T = rows * seq // cp
    P = tp_local_elements(cfg, tp)
    out: dict[str, Fraction] = {}
    if shard > 1:
        out["params: gather, forward"] = ring_bytes("all_gather", shard, P * b)
        out["params: gather again, backward (all but the lookup table)"] = \
            ring_bytes("all_gather", shard, (P - V * d // tp) * b)
        out["grads: reduce-scatter"] = ring_bytes("reduce_scatter", shard, P * b)
    if dp > 1:
        out["grads: all-reduce over dp"] = ring_bytes("all_reduce", dp, P // shard * b)
    if tp > 1:
        boundaries = 2 * L + 1  # per pass
        name = "activations: all-gather + reduce-scatter over tp" if layout.sp else "activations: all-reduce over tp"
        out[name] = 2 * boundaries * ring_bytes("all_reduce", tp, T * d * b)
        out["vocab-parallel loss: max, sum exp, target logit"] = ring_bytes("all_reduce", tp, 3 * T * b)
        if layout.sp:
            out["norm grads over tp (sequence shards)"] = boundaries * ring_bytes("all_reduce", tp, d // shard * b)
    if cp > 1:
        kv = 2 * rows * seq * cfg.n_kv_heads // tp * (d // cfg.n_heads) * b
        out["attention: K/V gather + dK/dV reduce-scatter"] = \
            L * (ring_bytes("all_gather", cp, kv) + ring_bytes("reduce_scatter", cp, kv))
    if cfg.moe:
        if not (ep == shard and tp == 1 and cp == 1):
            raise ValueError("the MoE minimum is written for ep = fsdp, without tp or cp")
        m, n = cfg.moe, len(cfg.moe_layers)
        rows_out = ring_bytes("all_to_all", ep, T * m.top_k * d * b)
        out["experts: rows out and back, forward and backward"] = n * 4 * rows_out
        out["experts: per-expert counts"] = n * ring_bytes("all_to_all", ep, INT64 * m.num_experts)
        out["experts: load over the data ranks"] = ring_bytes("all_reduce", dp * fsdp * cp, n * m.num_experts * FP32)
    return out


# ---------------------------------------------------------------------------- report

def known_excess(cfg: LlamaConfig, layout: Layout, batch: int, seq: int) -> dict[str, Fraction]:
    """Bytes an algorithm sends above the minimum by design, derived like the minimum (a
    measured excess that these terms do not account for exactly is reported as such)."""
    out = {}
    if layout.sp and layout.size("tp") > 1:
        T = batch // (layout.size("dp") * layout.size("fsdp")) * seq // layout.size("cp")
        out["sp: the kept sequence shards gathered again in backward (activations / tp)"] = \
            (2 * cfg.n_layers + 1) * ring_bytes("all_gather", layout.size("tp"), T * cfg.dim * FP32)
    if layout.size("cp") == 1 or layout.cp_comm != "ring":
        return out
    cp, tp, rows = layout.size("cp"), layout.size("tp"), batch // (layout.size("dp") * layout.size("fsdp"))
    block = 2 * rows * seq // cp * cfg.n_kv_heads // tp * (cfg.dim // cfg.n_heads) * FP32  # one rank's K/V
    L = cfg.n_layers
    return {**out, "ring: K/V sent around again in backward (no gathered K/V kept: memory O(S/cp))":
            Fraction(L * (cp - 1) * block),
            "ring: each dK/dV accumulator takes cp hops home, not cp-1 (it starts at the block's owner)":
            Fraction(L * block)}


@dataclass
class Result:
    name: str
    world: int
    parameters: int  # of this layout's model (the MoE layout's has experts)
    bytes: float  # measured, scalars left out
    minimum: float
    ratio: float
    explained: bool  # bytes == minimum + the known excess terms, exactly
    scalar_bytes: float
    scalar_count: int
    collectives: int  # calls per step, scalars left out (measured_by_kind splits them)
    measured_by_kind: dict = field(default_factory=dict)  # "phase op axis" -> {count, bytes}
    minimum_terms: dict = field(default_factory=dict)
    excess_terms: dict = field(default_factory=dict)


def _number(x: Fraction):
    return int(x) if x.denominator == 1 else float(x)


def measure(cfg: LlamaConfig, moe: MoeConfig, layout: Layout, batch: int, seq: int, bucket="block") -> Result:
    cfg = model_config(cfg, moe, layout)
    if parameter_count(cfg) != sum(s.numel for s in build("llama", cfg).specs.values()):
        raise RuntimeError("bench/comm.py: the closed-form parameter count differs from the model's specs")
    log = record_step(cfg, layout, batch, seq, bucket)
    tensors = [c for c in log if c.numel > 1]
    scalars = [c for c in log if c.numel <= 1]
    measured = sum((c.wire for c in tensors), Fraction(0))
    terms, excess = analytic_minimum(cfg, layout, batch, seq), known_excess(cfg, layout, batch, seq)
    minimum = sum(terms.values(), Fraction(0))
    kinds: dict[str, list] = defaultdict(lambda: [0, Fraction(0)])
    for c in tensors:
        kinds[f"{c.phase} {c.op} {c.axis}"][0] += 1
        kinds[f"{c.phase} {c.op} {c.axis}"][1] += c.wire
    return Result(layout.name, layout.world, parameter_count(cfg), _number(measured), _number(minimum),
                  float(measured / minimum),
                  measured == minimum + sum(excess.values(), Fraction(0)),
                  _number(sum((c.wire for c in scalars), Fraction(0))), len(scalars), len(tensors),
                  {k: {"count": n, "bytes": _number(v)} for k, (n, v) in sorted(kinds.items())},
                  {k: _number(v) for k, v in terms.items()}, {k: _number(v) for k, v in excess.items()})


def render(results: list[Result], header: str) -> str:
    lines = [header, "bytes: sent per rank per step, ring-algorithm convention; machine independent (no time "
             "is measured); scalar collectives apart. calls: collectives issued per step (tensor, scalar)", ""]
    cols = (f"{'layout':<16} {'world':>5} {'measured B':>14} {'minimum B':>14} {'ratio':>8} {'scalar B':>9} "
            f"{'calls':>6} {'scalar':>6}")
    lines += [cols, "-" * len(cols)]
    for r in results:
        lines.append(f"{r.name:<16} {r.world:>5} {r.bytes:>14,.0f} {r.minimum:>14,.0f} {r.ratio:>8.4f} "
                     f"{r.scalar_bytes:>9,.0f} {r.collectives:>6} {r.scalar_count:>6}")
    for r in results:
        if r.excess_terms:
            verdict = "account exactly for" if r.explained else "do NOT account for"
            lines += ["", f"{r.name}: above the minimum by design; these terms {verdict} the measured "
                      f"{r.bytes - r.minimum:,.0f} B:"]
            lines += [f"  {v:>12,} B  {k}" for k, v in r.excess_terms.items()]
    unexplained = [r.name for r in results if not r.explained]
    if unexplained:
        lines += ["", f"NOT EXPLAINED (measured != minimum + known excess): {', '.join(unexplained)}"]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="a small model and batch, for CI (seconds on a CPU)")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    p.add_argument("--layouts", nargs="*", metavar="NAME", help=f"a subset of {', '.join(x.name for x in LAYOUTS)}")
    p.add_argument("--bucket", default="block", metavar="UNIT",
                   help="the step's unit of parameter traffic: block (default), param (one collective per "
                        "parameter: the baseline) or a size in MB")
    args = p.parse_args(argv)
    try:
        bucket = check_bucket(args.bucket, "--bucket")
    except ValueError as e:  # ConfigError
        p.error(str(e))
    cfg, moe, batch, seq = SIZES["tiny" if args.tiny else "full"]
    layouts = [x for x in LAYOUTS if not args.layouts or x.name in args.layouts]
    if args.layouts and len(layouts) != len(set(args.layouts)):
        p.error(f"unknown layout in {args.layouts}")
    results = [measure(cfg, moe, layout, batch, seq, bucket) for layout in layouts]
    model = {**{k: v for k, v in cfg.__dict__.items() if k != "moe"}, "moe": asdict(moe), "batch": batch,
             "seq": seq, "precision": "fp32", "parameters": parameter_count(cfg), "bucket": bucket}
    header = (f"collective bytes per step: Llama dim {cfg.dim}, {cfg.n_layers} layers, vocab {cfg.vocab_size}, "
              f"{parameter_count(cfg):,} parameters, fp32, batch {batch} x {seq} tokens (MoE layout: every block "
              f"{moe.num_experts} experts, top {moe.top_k}, expert ffn {moe.expert_ffn_dim}); parameters moved per "
              f"{bucket if isinstance(bucket, str) else f'{bucket:g} MB'} (--bucket); fake process group, rank 0")
    print(render(results, header))
    if args.json:
        doc = {"layouts": [asdict(r) for r in results], "model": model,
               "convention": "bytes a rank sends per step, ring algorithm; scalar collectives apart",
               "command": " ".join(["python", *sys.argv]) if argv is None else " ".join(["bench/comm.py", *argv]),
               "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "torch": torch.__version__, "python": platform.python_version(), "process_group": "fake"}
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
