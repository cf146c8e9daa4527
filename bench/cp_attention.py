"""Context-parallel attention compute: what the zigzag block schedules cost against one
full-sequence attention, on one device, with no communication.

Each cp rank's share of the work (forward + backward of its blocks, with the log-sum-exp
merge) is run in turn on one device and timed. Two ratios per comm type and cp:

  overhead   sum over ranks of their time / the time of the whole sequence in one causal
             kernel call (the same block kernel: flash on CUDA bf16, math path on CPU).
             1.0 is free splitting; above it is what smaller kernels and the merge cost.
  imbalance  slowest rank / mean rank. Zigzag aims at 1.0; a contiguous split would give
             (2cp - 1) / cp (printed as `contiguous`).

Communication is not timed (the lent GPU machine has one GPU): this is the compute side
of CP. Reference and measurement share the process, kernels and inputs.

    python bench/cp_attention.py                      # CUDA: Llama-3-8B heads, S=32768, bf16
    python bench/cp_attention.py --tiny --json out.json   # CPU, seconds
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from meshtrain.layout.mesh import CP_COMMS  # noqa: E402
from meshtrain.parallel import cp_blocks, cp_exchanges  # noqa: E402
from meshtrain.parallel.zigzag import zigzag_order  # noqa: E402


WHOLE = [(slice(None), slice(None), True)]  # one causal block over the whole sequence


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _timed(fn, device, repeat):
    fn()  # warm-up
    _sync(device)
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t)
    return min(times)


def _blocks(q, dout, groups):
    """Forward and backward of q against groups of (k, v, pieces), merged by LSE into one
    output, as a rank does (backward needs the merged output first)."""
    out, lse = cp_blocks._running(q)
    for k, v, pieces in groups:
        cp_blocks._attend(q, k, v, pieces, out, lse)
    out = out.to(q.dtype)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for k, v, pieces in groups:
        dkv = torch.zeros((2,) + k.shape, dtype=torch.float32, device=q.device)
        cp_blocks._attend_backward(dout, q, k, v, out, lse, pieces, dq, dkv)


def rank_work(comm, r, cp, q, k, v, dout):
    """A closure running rank r's attention compute for this comm type (zigzag shards)."""
    S = q.shape[1]
    c = S // (2 * cp)
    perm = zigzag_order(S, cp).to(q.device)
    zq, zk, zv, zd = (t.index_select(1, perm).chunk(cp, 1) for t in (q, k, v, dout))
    if comm == "allgather":
        return lambda: _blocks(zq[r], zd[r], [(k, v, cp_exchanges._gather_pieces(r, cp, c))])
    if comm == "ring":
        return lambda: _blocks(zq[r], zd[r], [(zk[j], zv[j], cp_exchanges._ring_pieces(j, r, c)) for j in range(cp)])
    hq, hkv = q.shape[2] // cp, k.shape[2] // cp  # a2a: whole sequence, cp-th of the heads
    qh, kh, vh, dh = (t[:, :, r * h:(r + 1) * h] for t, h in ((q, hq), (k, hkv), (v, hkv), (dout, hq)))
    return lambda: _blocks(qh, dh, [(kh, vh, WHOLE)])


def measure(device, dtype, b, S, hq, hkv, d, cps, repeat):
    g = torch.Generator(device=device).manual_seed(0)
    q, dout = (torch.randn(b, S, hq, d, device=device, dtype=dtype, generator=g) for _ in range(2))
    k, v = (torch.randn(b, S, hkv, d, device=device, dtype=dtype, generator=g) for _ in range(2))
    full = _timed(lambda: _blocks(q, dout, [(k, v, WHOLE)]), device, repeat)
    rows = []
    for cp in cps:
        for comm in CP_COMMS:
            if comm == "a2a" and (hq % cp or hkv % cp):
                continue
            times = [_timed(rank_work(comm, r, cp, q, k, v, dout), device, repeat) for r in range(cp)]
            rows.append({"cp": cp, "comm": comm, "rank_ms": [round(t * 1e3, 3) for t in times],
                         "overhead": sum(times) / full, "imbalance": max(times) / statistics.mean(times),
                         "contiguous_imbalance": (2 * cp - 1) / cp})
    return {"full_ms": full * 1e3, "rows": rows}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="small shapes on the CPU (math path)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--seq", type=int, default=32768)
    ap.add_argument("--cp", type=int, nargs="+", default=[2, 4, 8])
    args = ap.parse_args(argv)
    if args.tiny:
        device, dtype = torch.device("cpu"), torch.float32
        shape = dict(b=1, S=256, hq=4, hkv=2, d=32)
        cps, repeat = [2, 4], 3
    else:
        if not torch.cuda.is_available():
            sys.exit("needs a CUDA GPU (or --tiny)")
        device, dtype = torch.device("cuda"), torch.bfloat16
        shape = dict(b=1, S=args.seq, hq=32, hkv=8, d=128)  # Llama-3-8B attention, one tp rank
        cps, repeat = args.cp, 5
    result = measure(device, dtype, cps=cps, repeat=repeat, **shape)
    result.update(device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                  dtype=str(dtype).removeprefix("torch."), torch=torch.__version__, **shape)
    print(f"{result['device']}, torch {result['torch']}, {result['dtype']}, b={shape['b']} S={shape['S']} "
          f"hq={shape['hq']} hkv={shape['hkv']} d={shape['d']}: whole sequence fwd+bwd {result['full_ms']:.2f} ms")
    print(f"{'cp':>3} {'comm':<10} {'overhead':>9} {'imbalance':>10} {'contiguous':>11}  per-rank ms")
    for r in result["rows"]:
        print(f"{r['cp']:>3} {r['comm']:<10} {r['overhead']:>9.3f} {r['imbalance']:>10.3f} "
              f"{r['contiguous_imbalance']:>11.3f}  {r['rank_ms']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
