"""One-GPU check of the fused (flash) path of meshtrain.parallel.cp_attention; no process group.

1. kernels: `_block_forward` / `_block_backward` on bf16/fp16 CUDA tensors (the fused aten flash
   ops) against the same functions on fp32 copies (the math path), causal square blocks and
   unmasked sq != sk blocks, GQA and MHA. The backward gets the same final out/lse on both paths.
2. layouts: the allgather and ring block schedules of cp=4 virtual ranks, run with the fused
   kernels and the log-sum-exp merge, against F.scaled_dot_product_attention in fp32 on the
   whole sequence (output and q/k/v gradients).
3. op: the custom op the runtime calls, eager and compiled (fullgraph), on a 1-rank NCCL
   group, every comm type (their fake kernels must match the real outputs' layouts).

Prints the max error of every comparison relative to the reference's max magnitude; exits 1 if
one is above the tolerance (bf16 3e-2, fp16 1e-2).

    python bench/cp_attention_gpu_check.py
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from meshtrain.parallel import cp_attention as cpa, cp_blocks, cp_exchanges  # noqa: E402
from meshtrain.parallel.zigzag import zigzag_order  # noqa: E402

TOL = {torch.bfloat16: 3e-2, torch.float16: 1e-2}
failures = []


def report(name, got, want, dtype):
    err = ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp(min=1e-6)).item()
    ok = err <= TOL[dtype]
    print(f"{'ok  ' if ok else 'FAIL'} {name:<58} rel max err {err:.2e}")
    if not ok:
        failures.append(name)


def kernels(dtype, b=2):
    g = torch.Generator(device="cuda").manual_seed(0)
    for hq, hkv, d in ((8, 2, 64), (4, 4, 128)):
        for sq, sk, causal in ((256, 256, True), (128, 384, False)):
            q, dout = (torch.randn(b, sq, hq, d, device="cuda", dtype=dtype, generator=g) for _ in range(2))
            k, v = (torch.randn(b, sk, hkv, d, device="cuda", dtype=dtype, generator=g) for _ in range(2))
            assert cp_blocks._use_fused(q) and not cp_blocks._use_fused(q.float())
            out, lse = cp_blocks._block_forward(q, k, v, causal)
            assert out.dtype == dtype and lse.dtype == torch.float32, (out.dtype, lse.dtype)
            ref_out, ref_lse = cp_blocks._block_forward(q.float(), k.float(), v.float(), causal)
            tag = f"{str(dtype)[6:]} hq={hq} hkv={hkv} d={d} sq={sq} sk={sk} causal={causal}"
            report(f"fwd out  {tag}", out, ref_out, dtype)
            report(f"fwd lse  {tag}", lse, ref_lse, dtype)
            got = cp_blocks._block_backward(dout, q, k, v, ref_out.to(dtype), ref_lse, causal)
            want = cp_blocks._block_backward(dout.float(), q.float(), k.float(), v.float(), ref_out, ref_lse, causal)
            for n, a, e in zip(("dq", "dk", "dv"), got, want):
                report(f"bwd {n}   {tag}", a, e, dtype)


def _inputs_and_reference(dtype, seed, b, S, hq, hkv, d):
    """Random q, k, v, dout in `dtype`, and fp32 SDPA's output and fp32 leaves (with .grad)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, dout = (torch.randn(b, S, hq, d, device="cuda", dtype=dtype, generator=g) for _ in range(2))
    k, v = (torch.randn(b, S, hkv, d, device="cuda", dtype=dtype, generator=g) for _ in range(2))
    leaves = [t.float().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in leaves), is_causal=True,
                                         enable_gqa=True).transpose(1, 2)
    ref.backward(dout.float())
    return (q, k, v, dout), ref, leaves


def layouts(dtype, cp=4, b=2, S=1024, hq=8, hkv=2, d=64):
    (q, k, v, dout), ref, leaves = _inputs_and_reference(dtype, 1, b, S, hq, hkv, d)
    perm, c = zigzag_order(S, cp).cuda(), S // (2 * cp)
    zig = [t.index_select(1, perm).chunk(cp, 1) for t in (q, k, v, dout)]
    want = [t.index_select(1, perm) for t in (ref.detach(), *(x.grad for x in leaves))]
    for comm in ("allgather", "ring"):
        outs, dqs = [], []
        dkv = torch.zeros(cp, 2, b, 2 * c, hkv, d, device="cuda")  # by owner rank (zigzag shards)
        for r in range(cp):
            ql, dl = zig[0][r], zig[3][r]
            out, lse = cp_blocks._running(ql)
            if comm == "allgather":  # keys in natural order
                pieces = cp_exchanges._gather_pieces(r, cp, c)
                cp_blocks._attend(ql, k, v, pieces, out, lse)
            else:
                for j in range(cp):
                    cp_blocks._attend(ql, zig[1][j], zig[2][j], cp_exchanges._ring_pieces(j, r, c), out, lse)
            out = out.to(dtype)
            dq = torch.zeros(ql.shape, device="cuda")
            if comm == "allgather":
                full = torch.zeros(2, b, S, hkv, d, device="cuda")
                cp_blocks._attend_backward(dl, ql, k, v, out, lse, pieces, dq, full)
                dkv += full.index_select(2, perm).unflatten(2, (cp, -1)).movedim(2, 0)
            else:
                for j in range(cp):
                    cp_blocks._attend_backward(dl, ql, zig[1][j], zig[2][j], out, lse, cp_exchanges._ring_pieces(j, r, c), dq, dkv[j])
            outs.append(out)
            dqs.append(dq)
        got = [torch.cat(outs, 1), torch.cat(dqs, 1), dkv[:, 0].movedim(0, 1).flatten(1, 2),
               dkv[:, 1].movedim(0, 1).flatten(1, 2)]
        for n, a, e in zip(("out", "dq", "dk", "dv"), got, want):
            report(f"{comm:<9} cp={cp} {str(dtype)[6:]} {n}", a, e, dtype)


def op(dtype, b=2, S=2048, hq=8, hkv=2, d=128):
    """The custom op (what the runtime calls), eager and under torch.compile(fullgraph=True),
    on a 1-rank NCCL group (cp = 1: every exchange runs, with itself), against fp32 SDPA."""
    import torch.distributed as dist

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29511")
        dist.init_process_group("nccl", rank=0, world_size=1)
    (q, k, v, dout), ref, ref_leaves = _inputs_and_reference(dtype, 2, b, S, hq, hkv, d)
    for comm in cpa.CP_COMMS:
        for compiled in (False, True):
            def fn(a, b_, c, comm=comm):
                return cpa.context_parallel_attention(a, b_, c, dist.group.WORLD, comm)
            run = torch.compile(fn, fullgraph=True) if compiled else fn
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            out = run(*leaves)
            out.backward(dout)
            mode = "compiled" if compiled else "eager"
            for n, a, e in zip(("out", "dq", "dk", "dv"), [out] + [t.grad for t in leaves],
                               [ref] + [t.grad for t in ref_leaves]):
                report(f"op {comm:<9} {mode:<8} {str(dtype)[6:]} {n}", a, e, dtype)


if __name__ == "__main__":
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    for dtype in (torch.bfloat16, torch.float16):
        kernels(dtype)
        layouts(dtype)
    op(torch.bfloat16)
    print(f"{len(failures)} failed" if failures else "all passed")
    sys.exit(1 if failures else 0)
