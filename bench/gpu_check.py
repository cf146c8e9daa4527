"""The CUDA-only branches, each run once on a lent GPU (issue 40, item 5); no process group.

  async_save    checkpoint/background.py with large CUDA tensors: save() returns, the tensors
                are changed at once on the GPU, and the checkpoint must hold the values of
                the step that saved, bit for bit (loaded back and compared with copies
                taken before save). Two saves: the second finds the staging buffers holding
                the first's values, so a writer that read them before the device-to-host
                copies finished would write the first step's bytes. The CUDA-only line is
                the `torch.cuda.synchronize()` after the staging copies: the check counts
                that it ran. `control` (information, not a verdict): the same with that
                synchronize made a no-op, how many tensors then differ (racy: 0 says only
                that the race was not seen).
  pinned        the staging buffers of CUDA tensors are in pinned host memory.
  fp8_<recipe>  models/fp8.py `fp8_linear` on CUDA (torch._scaled_mm), tensorwise and rowwise:
                y, grad_x and grad_w against an fp32 matmul of the dequantised operands
                (the same fp8 values and scales, multiplied out in fp32), and, as a bound,
                against the fp32 matmul of the unquantised ones; counts the _scaled_mm calls.
  grouped_<dt>  models/experts.py `grouped_linear` (torch._grouped_mm where `_grouped_mm_ok`
                holds) in bf16 and fp32, uneven rows per expert and one expert without any:
                y, dx, dw against a per-expert loop in fp32 written here; counts the
                _grouped_mm calls (3: forward and both backward products).
  mla_<dt>      what one DeepSeek-V3 block (multi-head latent attention: values narrower
                than keys, which CUDA's fused kernels take and the CPU's flash kernel does
                not) keeps for backward, bf16 and fp32: the bytes a forward of the model
                at 3 layers holds beyond one at 2 (CUDA: torch.cuda.memory_allocated; CPU:
                the allocator's events), against `meshtrain plan`'s per-layer figure for
                the device. Within 1% on CUDA (the caching allocator rounds each block),
                to the byte on the CPU.

Errors are max |got - reference| over max |reference|. One line per check (PASS/FAIL, its
numbers), and one JSON (`--json`, default $OUT/gpu_check.json or ./gpu_check.json) with the
date, the card and every number. Exit 1 if a check fails.

Without CUDA it says it needs a GPU and exits 0; `--smoke` runs the same code on the CPU with
small shapes (the CUDA-only lines are then not reached, which the JSON says), for CI
(tests/test_bench_gpu_kit.py).

    python bench/gpu_check.py                 # on the GPU machine (bench/gpu.sh runs it)
    python bench/gpu_check.py --smoke         # CPU, a few seconds
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from meshtrain import checkpoint as ckpt  # noqa: E402
from meshtrain.models import experts, fp8  # noqa: E402
from meshtrain.train.optim import init_state  # noqa: E402
from meshtrain.train.step import TrainState  # noqa: E402

# fp8: y and grads against the dequantised fp32 matmul (bf16 output rounding: <= 2^-9 of an
# element); the bound against the unquantised matmul (e4m3 forward, e5m2 gradients).
FP8_TOL, FP8_BOUND = 1e-2, {"y": 0.1, "grad_x": 0.25, "grad_w": 0.25}
GROUPED_TOL = {torch.bfloat16: 1e-2, torch.float32: 1e-5}


def _mla_config():
    """A dense DeepSeek-V3 (MLA with both latents, values narrower than keys; no YaRN,
    whose query gain is a float64 scalar autograd keeps beside the tensors)."""
    from meshtrain.models.deepseek_v3 import DeepseekV3Config
    from meshtrain.models.mla import MlaConfig

    mla = MlaConfig(q_lora_rank=192, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32)
    return DeepseekV3Config(dim=256, n_layers=2, n_heads=8, ffn_dim=512, vocab_size=512, max_seq_len=4096, mla=mla)


_MLA = _mla_config()


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp(min=1e-12)).item()


@contextmanager
def counting(module, name: str, counts: dict):
    """Count the calls of module.<name> (looked up at call time by the code under check)."""
    original = getattr(module, name)

    def wrapper(*args, **kwargs):
        counts[name] = counts.get(name, 0) + 1
        return original(*args, **kwargs)

    setattr(module, name, wrapper)
    try:
        yield counts
    finally:
        setattr(module, name, original)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


# ---------------------------------------------------------------- the background save

def _state(n: int, numel: int, device, seed: int) -> TrainState:
    g = torch.Generator(device=device).manual_seed(seed)
    params = {f"w{i}": torch.randn(numel, generator=g, device=device) for i in range(n)}
    state = TrainState(params, init_state(params), 0)
    for group in state.optimizer.values():
        for t in group.values():
            t.normal_(generator=g)
    return state


def _tensors(state) -> dict:
    return {**{("params", n): t for n, t in state.params.items()},
            **{(k, n): t for k, group in state.optimizer.items() for n, t in group.items()}}


def _host_copy(state) -> dict:
    return {k: t.detach().to("cpu", copy=True) for k, t in _tensors(state).items()}


def _mutate(state) -> None:
    """What training does to the state right after save() returns: every tensor changed in place."""
    with torch.no_grad():
        for t in _tensors(state).values():
            t.mul_(-2.0).add_(1.0)


def _differing(path: Path, want: dict, n: int, numel: int) -> list:
    fresh = _state(n, numel, torch.device("cpu"), seed=12345)
    ckpt.load(path, fresh)
    return [f"{k[0]}/{k[1]}" for k, t in _tensors(fresh).items() if not torch.equal(t, want[k])]


def _save_mutate_wait(saver, root, step: int, state, calls: dict) -> tuple[dict, float]:
    """(the values saved, seconds save() took): save, change every tensor at once, wait.
    `calls` counts the torch.cuda.synchronize calls inside save()."""
    want = _host_copy(state)
    _sync(next(iter(state.params.values())).device)
    t0 = time.perf_counter()
    with counting(torch.cuda, "synchronize", calls):
        saver.save(root, step, state, {"check": step}, keep_last=10)
    returned = time.perf_counter() - t0
    _mutate(state)
    saver.wait()
    return want, returned


def check_async_save(device, mib: int) -> dict:
    n = 4  # parameters; the optimizer holds 2 more of each: 3 n tensors
    numel = max(mib * 2 ** 20 // (3 * n * 4), 1024)
    state = _state(n, numel, device, seed=0)
    calls = {}
    with tempfile.TemporaryDirectory(prefix="meshtrain-gpu-check-") as tmp:
        root = Path(tmp)
        saver = ckpt.BackgroundSaver()
        saver.reserve(state)
        want1, s1 = _save_mutate_wait(saver, root / "a", 1, state, calls)
        want2, s2 = _save_mutate_wait(saver, root / "a", 2, state, calls)
        bad = _differing(root / "a" / "step_00000001", want1, n, numel) + \
            _differing(root / "a" / "step_00000002", want2, n, numel)
        pinned = [buf.is_pinned() for buf in saver._staging.values()]
        # Control: the synchronize made a no-op for one more save (information only).
        control = None
        if device.type == "cuda":
            original = torch.cuda.synchronize
            torch.cuda.synchronize = lambda *a, **k: None
            try:
                want3, _ = _save_mutate_wait(saver, root / "a", 3, state, {})
            finally:
                torch.cuda.synchronize = original
            control = len(_differing(root / "a" / "step_00000003", want3, n, numel))
    syncs = calls.get("synchronize", 0)
    on_cuda = device.type == "cuda"
    out = {"tensors": 3 * n, "mib": round(3 * n * numel * 4 / 2 ** 20, 1), "differing": bad,
           "synchronize_calls": syncs, "save_returned_s": [round(s1, 4), round(s2, 4)],
           "control_differing_without_sync": control,
           "pass": not bad and (syncs >= 2 if on_cuda else True)}
    pin = {"buffers": len(pinned), "pinned": sum(pinned), "pass": all(p == on_cuda for p in pinned) and bool(pinned)}
    return {"async_save": out, "pinned": pin}


# ---------------------------------------------------------------- fp8 GEMMs

def _dequantised(t, dtype, operand, dim, recipe):
    q, inv = fp8._quantize(t, dtype, operand, dim, recipe, None)
    return q.float() * inv


def check_fp8(device, recipe: str, m: int, k: int, n: int) -> dict:
    g = torch.Generator(device=device).manual_seed(1)
    dtype = torch.bfloat16
    x = torch.randn(m, k, generator=g, device=device).to(dtype).requires_grad_()
    w = (torch.randn(n, k, generator=g, device=device) / k ** 0.5).to(dtype).requires_grad_()
    dy = torch.randn(m, n, generator=g, device=device).to(dtype)
    calls = {}
    with counting(torch, "_scaled_mm", calls):
        y = fp8.fp8_linear(x, w, recipe)
        y.backward(dy)
    xd, wd = x.detach(), w.detach()
    ref = {"y": _dequantised(xd, fp8.FWD_DTYPE, "x", 1, recipe) @ _dequantised(wd, fp8.FWD_DTYPE, "w", 1, recipe).T,
           "grad_x": _dequantised(dy, fp8.GRAD_DTYPE, "grad", 1, recipe)
           @ _dequantised(wd, fp8.FWD_DTYPE, "w", 0, recipe),
           "grad_w": _dequantised(dy, fp8.GRAD_DTYPE, "grad", 0, recipe).T
           @ _dequantised(xd, fp8.FWD_DTYPE, "x", 0, recipe)}
    exact = {"y": xd.float() @ wd.float().T, "grad_x": dy.float() @ wd.float(), "grad_w": dy.float().T @ xd.float()}
    got = {"y": y.detach(), "grad_x": x.grad, "grad_w": w.grad}
    errs = {name: rel_err(got[name], ref[name]) for name in ref}
    bound = {name: rel_err(got[name], exact[name]) for name in ref}
    return {"shape": [m, k, n], "dtype": str(dtype), "scaled_mm_calls": calls.get("_scaled_mm", 0),
            "err_vs_dequantised": errs, "err_vs_unquantised": bound,
            "pass": calls.get("_scaled_mm", 0) == 3 and all(e <= FP8_TOL for e in errs.values())
            and all(bound[name] <= FP8_BOUND[name] for name in bound)}


# ---------------------------------------------------------------- grouped expert GEMM

def check_grouped(device, dtype, rows: int, d_in: int, d_out: int, e: int) -> dict:
    g = torch.Generator(device=device).manual_seed(2)
    # Uneven rows per expert, one expert (the second) without any.
    weights = torch.rand(e, generator=g, device=device) + 0.2
    weights[1] = 0
    counts = (weights / weights.sum() * rows).floor().long()
    counts[0] += rows - counts.sum()
    x = torch.randn(rows, d_in, generator=g, device=device).to(dtype).requires_grad_()
    w = (torch.randn(e, d_out, d_in, generator=g, device=device) / d_in ** 0.5).to(dtype).requires_grad_()
    dy = torch.randn(rows, d_out, generator=g, device=device).to(dtype)
    grouped = experts._grouped_mm_ok(x, w)
    calls, error = {}, None
    try:
        with counting(torch, "_grouped_mm", calls):
            y = experts.grouped_linear(x, w, counts)
            y.backward(dy)
    except Exception as exc:  # a kernel this card or dtype lacks: the check fails, saying why
        error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    out = {"rows": rows, "counts": counts.tolist(), "d_in": d_in, "d_out": d_out, "dtype": str(dtype),
           "grouped_mm_ok": grouped, "grouped_mm_calls": calls.get("_grouped_mm", 0)}
    if error is not None:
        return {**out, "error": error, "pass": False}
    sizes = counts.tolist()
    xs, dys = x.detach().float().split(sizes), dy.float().split(sizes)
    wf = w.detach().float()
    ref = {"y": torch.cat([r @ wf[i].T for i, r in enumerate(xs)]),
           "dx": torch.cat([d @ wf[i] for i, d in enumerate(dys)]),
           "dw": torch.stack([d.T @ r for d, r in zip(dys, xs)])}
    errs = {"y": rel_err(y.detach(), ref["y"]), "dx": rel_err(x.grad, ref["dx"]), "dw": rel_err(w.grad, ref["dw"])}
    empty_dw_zero = bool((w.grad[1] == 0).all())
    return {**out, "err": errs, "empty_expert_dw_zero": empty_dw_zero,
            "pass": grouped and calls.get("_grouped_mm", 0) == 3 and empty_dw_zero
            and all(v <= GROUPED_TOL[dtype] for v in errs.values())}


# ---------------------------------------------------------------- main

def _mla_held(device, n: int, precision: str, batch: int, seq: int) -> int:
    """Bytes one forward of an n-layer dense MLA model holds when it returns (what autograd
    keeps, and the loss), parameters made before."""
    import dataclasses

    from meshtrain import build
    from meshtrain.models.context import LocalContext
    from meshtrain.models.policy import Policy
    from meshtrain.models.spec import init_slice
    from meshtrain.train.peak_memory import held_cpu_bytes

    model = build("deepseek_v3", dataclasses.replace(_MLA, n_layers=n))
    params = {k: init_slice(s, k, seed=0).to(device).requires_grad_(s.trainable) for k, s in model.specs.items()}
    tokens = torch.randint(0, model.cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    tokens = tokens.to(device)
    ctx = LocalContext(Policy.of(precision))

    def forward():
        return ctx.cross_entropy_sum(model.forward(params, tokens, ctx), tokens)

    if device.type == "cpu":
        loss, held = held_cpu_bytes(forward)
    else:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        loss = forward()
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - before
    loss.backward()  # what was kept is used
    return held


def check_mla_memory(device, precision: str, batch: int, seq: int) -> dict:
    import dataclasses

    from meshtrain import MeshSpec, Rules, build, make_plan
    from meshtrain.estimate.memory import per_rank_memory

    measured = _mla_held(device, 3, precision, batch, seq) - _mla_held(device, 2, precision, batch, seq)
    planned = []
    for n in (2, 3):
        model = build("deepseek_v3", dataclasses.replace(_MLA, n_layers=n))
        plan = make_plan(model.specs, Rules.default(), MeshSpec(), world=1)
        planned.append(per_rank_memory(plan, model, micro_batch=batch, seq_len=seq, precision=precision,
                                       device=device.type)["activations"])
    planner = planned[1] - planned[0]
    tol = 0.01 if device.type == "cuda" else 0.0
    return {"measured": measured, "planner": planner, "ratio": round(planner / measured, 4),
            "pass": abs(planner - measured) <= tol * measured}


def _line(name: str, r: dict) -> str:
    verdict = "PASS" if r.get("pass") else "FAIL"
    if r.get("skipped"):
        verdict = "SKIP"
    keep = {k: v for k, v in r.items() if k != "pass"}
    return f"{verdict} {name:<18} " + json.dumps(keep, default=str)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="the same code on the CPU, small shapes (CI)")
    p.add_argument("--json", type=Path, default=Path(os.environ.get("OUT", ".")) / "gpu_check.json")
    p.add_argument("--save-mib", type=int, default=None, help="checkpoint size (default 768 on GPU, 4 smoke)")
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        print("gpu_check: needs a CUDA GPU, and there is none here: nothing checked "
              "(`--smoke` runs the same code on the CPU)")
        return 0
    device = torch.device("cuda" if cuda and not args.smoke else "cpu")
    results = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "smoke": args.smoke,
               "torch": torch.__version__, "cuda": torch.version.cuda,
               "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
               "capability": list(torch.cuda.get_device_capability()) if device.type == "cuda" else None,
               "cuda_only_lines_reached": device.type == "cuda", "checks": {}}
    big = device.type == "cuda"
    start = time.monotonic()

    def run(name, fn, *a):
        t0 = time.perf_counter()
        try:
            out = fn(*a)
        except Exception as exc:  # one check's failure does not stop the others
            out = {name: {"error": f"{type(exc).__name__}: {exc}", "pass": False}}
        for key, r in out.items():
            r["seconds"] = round(time.perf_counter() - t0, 2)
            results["checks"][key] = r
            print(_line(key, r), flush=True)

    run("async_save", check_async_save, device, args.save_mib or (768 if big else 4))
    fp8_ok = device.type != "cuda" or torch.cuda.get_device_capability() >= (8, 9)
    for recipe in fp8.RECIPES:
        if fp8_ok:
            run(f"fp8_{recipe}", lambda r=recipe: {f"fp8_{r}": check_fp8(device, r, *((2048, 4096, 2048) if big
                                                                                    else (32, 64, 48)))})
        else:
            results["checks"][f"fp8_{recipe}"] = r = {"skipped": "fp8 _scaled_mm needs compute capability 8.9+"}
            print(_line(f"fp8_{recipe}", r))
    for dtype in (torch.bfloat16, torch.float32):
        name = f"grouped_{str(dtype).split('.')[-1]}"
        run(name, lambda dt=dtype, nm=name: {nm: check_grouped(device, dt, *((8192, 1024, 2048, 8) if big
                                                                          else (96, 32, 48, 4)))})
    for precision in ("bf16", "fp32"):
        name = f"mla_{precision}"
        run(name, lambda pr=precision, nm=name: {nm: check_mla_memory(device, pr, *((4, 2048) if big else (2, 64)))})
    checks = results["checks"].values()
    results["passed"] = all(r.get("pass") or r.get("skipped") for r in checks)
    results["seconds"] = round(time.monotonic() - start, 1)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=1, default=str) + "\n")
    print(f"gpu_check: {'all passed' if results['passed'] else 'FAILED'} on {results['device']} "
          f"({results['seconds']} s); {args.json}")
    return 0 if results["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
