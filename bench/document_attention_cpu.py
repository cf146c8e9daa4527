"""Attention over packed documents against one causal mask over the row (issue 24), on CPU.

One row of --seq tokens (default 4096) made of equal documents of each --doc_lens length,
8 heads of 64 (GQA: 4 key/value heads), fp32, forward and backward of the sum of the
output squared. Five ways, in the same process, alternating over --rounds rounds:

  causal            one causal mask over the whole row (today without data.document_mask:
                    it attends across documents, so it is the cost to beat, not the same
                    numbers)
  tiled             meshtrain's eager document attention (models/attention.py): each tile
                    of 128 queries over its documents' span only
  dense             one block-diagonal causal mask over the row
  compiled_causal   causal, torch.compile'd (--compile backend)
  compiled_windowed meshtrain's compiled document attention: each tile over one window
                    of keys for the batch (document_window), static shapes; the dense
                    mask where the window would be the row, plain causal attention
                    where no row has a document boundary

tiled, dense and compiled_windowed must agree (output rtol 1e-5) or nothing is timed.
Reported per length: median ms of each, tiled / causal, dense / causal and
compiled_windowed / compiled_causal.

    python bench/document_attention_cpu.py --json out.json   # ~1 min on one core
    python bench/document_attention_cpu.py --tiny --compile aot_eager   # CI-sized
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
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from meshtrain.models.attention import (dense_document_attention, document_attention, document_window,  # noqa: E402
                                        tiled_document_attention)


def _window(window: int | None, seq: int) -> str:
    return "0 (causal)" if window == 0 else str(window or f"{seq} (dense)")


def fwd_bwd(fn, q, k, v):
    for t in (q, k, v):
        t.grad = None
    out = fn(q, k, v)
    out.square().sum().backward()
    return out.detach()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--doc_lens", type=int, nargs="+", default=[128, 512, 4096])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tiny", action="store_true", help="seq 512, documents 64 and 512, 2 rounds")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--compile", default="inductor", help="backend of the compiled ways (inductor, aot_eager)")
    args = p.parse_args(argv)
    if args.tiny:
        args.seq, args.doc_lens, args.rounds = 512, [64, 512], 2
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 8, args.seq, 64, generator=g).requires_grad_()
    k, v = (torch.randn(1, 4, args.seq, 64, generator=g).requires_grad_() for _ in range(2))
    report = {"torch": torch.__version__, "cores": os.cpu_count(), "seq": args.seq, "heads": 8, "kv_heads": 4,
              "head_dim": 64, "rounds": args.rounds, "compile": args.compile, "by_doc_len": {}}
    causal = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # noqa: E731
    for length in args.doc_lens:
        segments = (torch.arange(args.seq) // length)[None]
        window = document_window(segments)
        torch._dynamo.reset()
        ways = {"causal": causal, "tiled": lambda q, k, v: tiled_document_attention(q, k, v, segments),
                "dense": lambda q, k, v: dense_document_attention(q, k, v, segments),
                "compiled_causal": torch.compile(causal, backend=args.compile, fullgraph=True, dynamic=False),
                "compiled_windowed": torch.compile(lambda q, k, v: document_attention(q, k, v, segments, window=window),
                                                   backend=args.compile, fullgraph=True, dynamic=False)}
        outs = {name: fwd_bwd(fn, q, k, v) for name, fn in ways.items()}  # warm-up (compiles), and the check
        for name in ("tiled", "compiled_windowed"):
            if not torch.allclose(outs[name], outs["dense"], rtol=1e-5, atol=1e-6):
                print(f"documents of {length}: {name} and dense disagree; nothing timed")
                return 1
        ms = {name: [] for name in ways}
        for rnd in range(args.rounds):
            for name in (list(ways) if rnd % 2 == 0 else list(reversed(ways))):
                t0 = time.perf_counter()
                fwd_bwd(ways[name], q, k, v)
                ms[name].append(1e3 * (time.perf_counter() - t0))
        med = {name: statistics.median(v) for name, v in ms.items()}
        row = {"ms": med, "rounds_ms": ms, "window": window, "tiled_over_causal": med["tiled"] / med["causal"],
               "dense_over_causal": med["dense"] / med["causal"],
               "compiled_windowed_over_compiled_causal": med["compiled_windowed"] / med["compiled_causal"]}
        report["by_doc_len"][str(length)] = row
        print(f"documents of {length:5d}: causal {med['causal']:8.1f} ms, tiled {med['tiled']:8.1f} ms "
              f"({row['tiled_over_causal']:.2f}x), dense mask {med['dense']:8.1f} ms ({row['dense_over_causal']:.2f}x); "
              f"compiled: causal {med['compiled_causal']:8.1f} ms, window {_window(window, args.seq)} "
              f"{med['compiled_windowed']:8.1f} ms ({row['compiled_windowed_over_compiled_causal']:.2f}x)")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
