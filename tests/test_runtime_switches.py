"""Every runtime switch alone, against an independent computation (issue 40, item 1).

Switches that must not change the numbers beyond rounding (the sharded step's parameter
traffic: parallel.bucket, parallel.prefetch, parallel.reshard_after_forward; and
checkpoint.async_save) are each turned on alone, every other key at its default, and
compared with one process (test_equivalence's reference: the whole batch in one step, no
plan, none of the bucket, gather or reduction code): loss and gradient norm per step
(rtol 1e-5, the clip below every norm, so a wrong norm scales every update), the first
step's whole gradients, the final parameters and Adam moments (which see a constant-factor
gradient error that Adam's update hides). All run in one 2-rank launch. The background
save is compared byte for byte with the synchronous save of the same sharded state while
the next step changes that state in place.

Switches that do change the numbers are compared with a by-hand computation written here:
train.fp8_recipe (tensorwise, rowwise), against matmuls of operands rounded to fp8 with
the recipe's scales (amax over the tensor or along each GEMM's contracted dim) and
dequantised to fp32, per GEMM and for a whole training step; model.moe.balance (aux,
aux_free, none), against the balance loss and the bias update computed from the router's
logits (f_i P_i per sequence; sign(mean load - load) over the global batch).

The switches left out here have such a test elsewhere, alone and against one process:
parallel.fsdp_accumulate (test_equivalence.py
test_unsharded_accumulation_matches_single_process), parallel.pp_keep_gathered and the
zero-bubble I/W split (test_pipeline_exec.py: 1f1b_pp2_fsdp2_kept and zb_pp2, eager and
compiled), train.activation_checkpointing (test_policies.py: selective and full against
none on one process, which recomputes nothing).
"""

from __future__ import annotations

import dataclasses
import filecmp
import os
import re
import threading

import pytest
import torch
import torch.nn.functional as F

from meshtrain import MeshSpec, Rules, TrainState, build, init_params, make_plan, make_train_step
from meshtrain.models.context import LocalContext
from meshtrain.models.fp8 import fp8_linear
from meshtrain.models.moe import MoeConfig, route
from meshtrain.models.policy import Policy
from meshtrain.models.spec import init_slice
from meshtrain.testing import run_ranks

from support.equivalence import (BATCH, CFG, GRAD_CLIP, LOSS_RTOL, NORM_RTOL, GradRecorder, batches, check_layouts,
                                 optimizer_args, single_process, train_layouts)

# --- the sharded step's parameter traffic, one switch at a time ----------------------------

# A bucket size (MB) whose buckets cross block boundaries: 0.03 MB holds layers.0's
# w_down (19.2 kB) with layers.1's attention norm and wq (asserted below).
SPANNING_MB = 0.03
# case: (test_equivalence layout, the one switch away from its default). bucket param
# runs each parameter through DTensor's own redistribute (no flat buffers): on fsdp
# (gather, reduce-scatter), dp (all-reduce), tp + sp (the norms' all-reduce over tp) and
# cp (gathered over cp, gradients partial over it).
SWITCHES = {
    "fsdp2_bucket_param": ("fsdp2", {"bucket": "param"}),
    "dp2_bucket_param": ("dp2", {"bucket": "param"}),
    "tp2_sp_bucket_param": ("tp2_sp", {"bucket": "param"}),
    "cp2_bucket_param": ("cp2_allgather", {"bucket": "param"}),
    "fsdp2_bucket_0.03mb": ("fsdp2", {"bucket": SPANNING_MB}),
    "fsdp2_prefetch0": ("fsdp2", {"prefetch": 0}),
    "fsdp2_prefetch3": ("fsdp2", {"prefetch": 3}),  # every bucket gathered ahead at the first
    "dp2_prefetch0": ("dp2", {"prefetch": 0}),  # (prefetch also bounds the reductions in flight)
    "fsdp2_no_reshard": ("fsdp2", {"reshard_after_forward": False}),
}


def _async_save_files(root: str) -> dict:
    """On every rank: an fsdp2 state after one step saved synchronously and in the
    background; the next step runs (changing every parameter and moment in place) while
    the background write is in flight. Returns what rank 0 compares: the names of each
    checkpoint's files and which tensor files differ."""
    import torch.distributed as dist

    from meshtrain import checkpoint as ckpt

    model = build("llama", CFG)
    plan = make_plan(model.specs, Rules.default(), MeshSpec(fsdp=2), world=dist.get_world_size())
    mesh = plan.mesh.build()
    state = TrainState.create(init_params(plan, mesh, seed=0))
    step = make_train_step(model, plan, mesh, **optimizer_args())
    data = batches(micro_steps=2)
    step(state, next(data))
    sync = ckpt.save(os.path.join(root, "sync"), 1, state, {"n": 1}, keep_last=2)
    saver = ckpt.BackgroundSaver()
    release = threading.Event()
    final = saver.save(os.path.join(root, "async"), 1, state, {"n": 1}, keep_last=2, on_write=lambda: release.wait(60))
    before = {n: p.full_tensor().clone() for n, p in state.params.items()}
    step(state, next(data))  # training goes on while the writer is held inside its first file
    changed = all(not torch.equal(p.full_tensor(), before[n]) for n, p in state.params.items())
    release.set()
    saver.wait()
    dist.barrier()
    out = {"changed": changed}
    if dist.get_rank() == 0:
        names = sorted(os.listdir(sync))
        out["files"] = (names, sorted(os.listdir(final)))
        out["differ"] = [n for n in names
                         if n.endswith(".distcp") and not filecmp.cmp(sync / n, final / n, shallow=False)]
        out["meta"] = ckpt.read_meta(sync) == ckpt.read_meta(final)
    return out


def _sharded_switches(world: int, root: str) -> dict:
    """On every rank: each case of SWITCHES (test_equivalence.train_layouts' 6 steps of 2
    micro-steps), then the background save."""
    out = {case: train_layouts(world, False, [layout], traffic)[layout]
           for case, (layout, traffic) in SWITCHES.items()}
    out["async_save"] = _async_save_files(root)
    return out


_LAUNCH = {}


def _launch(tmp_path_factory) -> list:
    """Each rank's results of _sharded_switches: one launch of 2 ranks for the file."""
    if "runs" not in _LAUNCH:
        root = tmp_path_factory.mktemp("async_save")
        _LAUNCH["runs"] = run_ranks(_sharded_switches, 2, 2, str(root))
    return _LAUNCH["runs"]


@pytest.fixture(scope="module")
def reference():
    return single_process()


def test_a_size_bucket_spans_a_block_boundary():
    """Guards the size case: some 0.03 MB bucket holds weights of two blocks."""
    from meshtrain.layout.buckets import plan_buckets

    plan = make_plan(build("llama", CFG).specs, Rules.default(), MeshSpec(fsdp=2), world=2)
    blocks = [{n.split(".")[1] for n in b.names if n.startswith("layers.")} for b in plan_buckets(plan, SPANNING_MB)[0]]
    assert any(len(b) == 2 for b in blocks), blocks


@pytest.mark.slow
@pytest.mark.parametrize("case", list(SWITCHES))
def test_traffic_switch_alone_equals_one_process(reference, tmp_path_factory, case):
    for rank_result in _launch(tmp_path_factory):  # every rank sees the same replicated numbers
        check_layouts(reference, {case: rank_result[case]})


@pytest.mark.slow
def test_background_save_is_the_synchronous_one_on_sharded_state(tmp_path_factory):
    """checkpoint.async_save on fsdp2: each rank's tensor file is byte for byte the one the
    synchronous save wrote of the same state, though the next step changed the state while
    the write was in flight (held inside the first file until that step was done)."""
    ranks = _launch(tmp_path_factory)
    assert all(r["async_save"]["changed"] for r in ranks)
    saved = ranks[0]["async_save"]
    names, async_names = saved["files"]
    assert names == async_names and sum(n.endswith(".distcp") for n in names) == 2, saved["files"]
    assert saved["differ"] == [] and saved["meta"], saved


# --- train.fp8_recipe: by-hand dequantised matmuls -----------------------------------------

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def dequantised(t: torch.Tensor, fp8: torch.dtype, contracted: int, recipe: str) -> torch.Tensor:
    """t as a GEMM sees it: multiplied by the scale fp8 max / amax (amax of the whole
    tensor, or rowwise of each row along the contracted dim), saturated, rounded to `fp8`,
    and multiplied back by 1/scale, in fp32."""
    fmax = torch.finfo(fp8).max
    t = t.float()
    amax = t.abs().amax() if recipe == "tensorwise" else t.abs().amax(contracted, keepdim=True)
    scale = fmax / amax.clamp(min=1e-12)
    return (t * scale).clamp(-fmax, fmax).to(fp8).float() * scale.reciprocal()


class HandFp8Linear(torch.autograd.Function):
    """y = x @ w.T and its two gradient GEMMs on dequantised operands: x and w in e4m3, the
    incoming gradient in e5m2; rowwise, each operand scaled along the dim its GEMM
    contracts (K forward; N for grad_x; M for grad_w). fp32 GEMMs, results in the
    operands' dtypes."""

    @staticmethod
    def forward(ctx, x, w, recipe):
        ctx.save_for_backward(x, w)
        ctx.recipe = recipe
        return (dequantised(x, E4M3, 1, recipe) @ dequantised(w, E4M3, 1, recipe).T).to(x.dtype)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        r = ctx.recipe
        grad_x = dequantised(g, E5M2, 1, r) @ dequantised(w, E4M3, 0, r)
        grad_w = dequantised(g, E5M2, 0, r).T @ dequantised(x, E4M3, 0, r)
        return grad_x.to(x.dtype), grad_w.to(w.dtype), None


def _gemm_inputs():
    """Rows and columns of very different magnitudes, so each rowwise scale differs from
    the tensor's and from the other dim's."""
    g = torch.Generator().manual_seed(7)
    m, k, n = 32, 48, 40
    x = torch.randn(m, k, generator=g) * torch.logspace(-3, 1, m)[:, None] * torch.logspace(0, 1, k)
    w = torch.randn(n, k, generator=g) * torch.logspace(-2, 0, n)[:, None]
    gy = torch.randn(m, n, generator=g) * torch.logspace(-4, -1, n) * torch.logspace(0, 2, m)[:, None]
    return x, w, gy


def _three_gemms(fn, x, w, gy, *args):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fn(x, w, *args)
    return (y, *torch.autograd.grad(y, (x, w), gy))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_gemms_equal_dequantised_fp32_matmuls(recipe, dtype, one_thread):
    """fp8_linear's y, grad_x and grad_w against HandFp8Linear: rtol 1e-5 of each output's
    largest value (measured: equal, torch 2.13 CPU). The other recipe's hand result differs
    by far more, so the comparison tells the recipes (and their dims) apart."""
    x, w, gy = (t.to(dtype) for t in _gemm_inputs())
    got = _three_gemms(fp8_linear, x, w, gy, recipe)
    want = _three_gemms(HandFp8Linear.apply, x, w, gy, recipe)
    other = _three_gemms(HandFp8Linear.apply, x, w, gy, OTHER_RECIPE[recipe])
    for what, a, b, c in zip(("y", "grad_x", "grad_w"), got, want, other):
        assert a.dtype == b.dtype == dtype, what
        tol = 1e-5 * b.float().abs().max().item()
        torch.testing.assert_close(a.float(), b.float(), rtol=0, atol=tol, msg=lambda m: f"{recipe} {what}: {m}")
        assert (c.float() - b.float()).abs().max() > 100 * tol, (recipe, what)


# The block linears: every linear but the embedding (a lookup), the head and the router.
BLOCK_LINEAR = re.compile(r"layers\.\d+\.(attn\.w[qkvo]|mlp\.w_(gate|up|down))")


class HandFp8Context(LocalContext):
    """One process in bf16 whose block linears are HandFp8Linear (what train.precision
    fp8 must run), and every other linear a plain bf16 F.linear."""

    def __init__(self, recipe: str):
        super().__init__(Policy(torch.bfloat16))
        self.recipe, self.fp8_calls = recipe, 0

    def linear(self, x, params, name, bias=None):
        if not BLOCK_LINEAR.fullmatch(name):
            return F.linear(x, params[name], bias)
        self.fp8_calls += 1
        out = HandFp8Linear.apply(x.reshape(-1, x.shape[-1]), params[name], self.recipe)
        return out.reshape(*x.shape[:-1], -1) if bias is None else out.reshape(*x.shape[:-1], -1) + bias


def _by_hand(model, params: dict, batch: dict, ctx) -> tuple[float, float, dict]:
    """(loss, gradient norm, gradients) of the mean token loss of the whole batch from
    `params`, by a forward with `ctx` and torch's cross-entropy."""
    leaves = {n: p.detach().clone().requires_grad_(p.requires_grad) for n, p in params.items()}
    tokens, targets = batch["tokens"].flatten(0, 1), batch["targets"].flatten(0, 1)
    logits = model.forward(leaves, tokens, ctx)
    loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum") / targets.numel()
    extra = getattr(ctx, "objective_extra", lambda: 0.0)()
    (loss + extra).backward()
    grads = {n: p.grad for n, p in leaves.items() if p.requires_grad}
    norm = torch.cat([g.flatten() for g in grads.values()]).double().norm().item()
    return loss.item(), norm, grads


def close(got: float, want: float, rtol: float, what: str) -> None:
    """A scalar against its hand value (as one-element tensors: a failure then reports its
    difference over the tolerance as tests/mutants.py reads it)."""
    torch.testing.assert_close(torch.tensor([got], dtype=torch.float64), torch.tensor([want], dtype=torch.float64),
                               rtol=rtol, atol=0, msg=lambda m: f"{what}: {m}")


def _steps_against_hand(model, step, params: dict, make_ctx, steps: int, micro_steps: int, grad_atol: float,
                        after_step=None) -> list[dict]:
    """Runs `step` for `steps` steps; before each, the by-hand loss, norm and gradients
    from the same parameters; each step's metrics, recorded gradients and norm must equal
    them (loss, norm rtol 1e-5; gradients atol grad_atol). Returns the metrics."""
    recorder = GradRecorder(range(1, steps + 1))
    state = TrainState.create(params)
    step = step(recorder)
    out = []
    for t, batch in enumerate(batches(micro_steps, steps), start=1):
        ctx = make_ctx(state.params)
        loss, norm, grads = _by_hand(model, state.params, batch, ctx)
        metrics = step(state, batch)
        close(metrics["loss"], loss, LOSS_RTOL, f"step {t} loss")
        close(metrics["grad_norm"], norm, NORM_RTOL, f"step {t} gradient norm")
        assert norm > 1.5 * GRAD_CLIP, (t, norm)  # clipping engages: a wrong norm scales the update
        assert sorted(recorder.grads[t]) == sorted(grads), t
        for n, g in grads.items():
            torch.testing.assert_close(recorder.grads[t][n], g, rtol=0, atol=grad_atol,
                                       msg=lambda m: f"step {t} gradient of {n}: {m}")
        if after_step is not None:
            after_step(t, ctx, state, metrics)
        out.append(metrics)
    return out


# Step-level gradients against the hand run: measured equal (torch 2.13 CPU; the GEMMs are
# bitwise the hand ones), held to test_equivalence's GRAD_ATOL. The other recipe's hand
# gradients differ by 2.4e-3 to 3.1e-3 (1e4 times this).
FP8_STEP_GRAD_ATOL = 2e-7
OTHER_RECIPE = {"tensorwise": "rowwise", "rowwise": "tensorwise"}


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_step_equals_by_hand_dequantised_gemms(recipe, one_thread):
    """train.precision fp8 with train.fp8_recipe `recipe`, everything else at its default,
    on one process, 3 steps: each step's loss, gradient norm and every gradient equal a bf16
    forward and backward whose 7 block linears per block run HandFp8Linear and whose
    embedding and head run plain bf16 (the loss by torch's cross-entropy). Guarded: the
    other recipe's hand run differs by far more than the tolerances."""
    model = build("llama", CFG)
    params = {n: init_slice(s, n, seed=0).requires_grad_() for n, s in model.specs.items()}
    contexts = []

    def make_ctx(_):
        contexts.append(HandFp8Context(recipe))
        return contexts[-1]

    def step(recorder):
        return make_train_step(model, precision="fp8", fp8_recipe=recipe, inspect_grads=recorder, **optimizer_args())

    _steps_against_hand(model, step, params, make_ctx, steps=3, micro_steps=1, grad_atol=FP8_STEP_GRAD_ATOL)
    assert all(c.fp8_calls == 7 * CFG.n_layers for c in contexts)
    batch = next(batches(1, 1))
    here, there = (_by_hand(model, params, batch, HandFp8Context(r))[2] for r in (recipe, OTHER_RECIPE[recipe]))
    assert max((here[n] - there[n]).abs().max() for n in here) > 100 * FP8_STEP_GRAD_ATOL


# --- model.moe.balance: the balance loss and the bias update by hand -------------------------

# 8 experts, top 2, both blocks MoE, z-loss off (the default), so aux_loss is the balance
# loss alone; aux_coef 0.1 so its gradient shows in the norm (guarded below).
MOE = MoeConfig(num_experts=8, top_k=2, expert_ffn_dim=32, aux_coef=0.1, bias_update_rate=1e-2)
MOE_CFG = dataclasses.replace(CFG, moe=MOE)
MOE_STEPS = 4
MOE_GRAD_ATOL = 3e-7  # test_moe's: the same model size, the step against one whole batch


class RouterLogits(LocalContext):
    """One process (fp32) keeping each MoE block's router logits (tokens, E) and the aux-
    free bias it routed with, in forward order: from the router's own input and weight,
    not from the code that computes the balance terms. The routing the block then runs
    (`route`) is checked against the hand one: experts chosen by probability + bias, gates
    the chosen probabilities renormalised (the bias never in a gate)."""

    def __init__(self):
        super().__init__()
        self.logits, self.biases = [], []

    def moe(self, h, cfg, router, bias, *experts):
        logits = F.linear(h.float(), router.float()).flatten(0, 1)
        self.logits.append(logits)
        self.biases.append(None if bias is None else bias.detach().clone())
        idx, gates, _ = route(logits, cfg, bias)
        probs = logits.detach().softmax(-1)
        want = (probs if bias is None else probs + bias.detach()).topk(cfg.top_k, -1).indices
        assert torch.equal(idx.sort(-1).values, want.sort(-1).values)
        chosen = probs.gather(-1, idx)
        torch.testing.assert_close(gates.detach(), chosen / chosen.sum(-1, keepdim=True), rtol=1e-6, atol=0)
        return super().moe(h, cfg, router, bias, *experts)


def hand_balance(logits: torch.Tensor, bias, cfg: MoeConfig, batch: int):
    """From one block's router logits (batch x seq tokens, E): (the balance loss averaged
    over the batch's sequences, tokens per expert of the whole batch). Per sequence,
    aux_coef x E x sum_i f_i P_i: f_i the share of the sequence's k x seq routed slots that
    go to expert i (chosen by score + bias), P_i its mean probability; f is not
    differentiated."""
    e, k = cfg.num_experts, cfg.top_k
    probs = logits.softmax(-1)
    choice = probs if bias is None else probs + bias
    picked = F.one_hot(choice.topk(k, -1).indices, e).sum(-2).float()  # (tokens, E), 0 or 1
    f = picked.view(batch, -1, e).mean(1) / k
    p = probs.view(batch, -1, e).mean(1)
    loss = (cfg.aux_coef * e * (f * p).sum(-1)).mean()
    return loss, picked.sum(0)


@pytest.mark.parametrize("balance", ["aux", "aux_free", "none"])
def test_moe_balance_mode_equals_by_hand(balance, one_thread):
    """model.moe.balance alone, one process, 4 steps of 2 micro-steps: each step's loss,
    gradient norm and gradients equal the by-hand objective's (the token loss plus, for aux,
    hand_balance's loss from the router logits); aux_loss is hand_balance's; the load
    imbalance is max/mean of the hand loads; aux_free's bias after each step is the bias
    before plus bias_update_rate x sign(mean load - load), exactly, and shifts the choice
    of experts; none adds no term and has no bias."""
    cfg = dataclasses.replace(MOE_CFG, moe=dataclasses.replace(MOE, balance=balance))
    model = build("llama", cfg)
    params = {n: init_slice(s, n, seed=0).requires_grad_(s.trainable) for n, s in model.specs.items()}
    bias_names = [f"layers.{i}.moe.expert_bias" for i in range(cfg.n_layers)]
    assert all((n in params) == (balance == "aux_free") for n in bias_names)
    seen = {"shifted": 0}

    def make_ctx(_):
        ctx = RouterLogits()
        ctx.batch_rows = BATCH
        hand = {}

        def extra():
            terms = [hand_balance(lg, b, cfg.moe, ctx.batch_rows) for lg, b in zip(ctx.logits, ctx.biases)]
            hand["loss"] = sum(t[0] for t in terms)
            hand["load"] = torch.stack([t[1] for t in terms])
            return hand["loss"] if balance == "aux" else 0.0

        ctx.objective_extra, ctx.hand = extra, hand
        return ctx

    def after_step(t, ctx, state, metrics):
        load = ctx.hand["load"]
        close(metrics["expert_imbalance"], (load.amax(-1) / load.mean(-1)).max().item(), 1e-6, f"step {t} imbalance")
        if balance == "aux":
            close(metrics["aux_loss"], ctx.hand["loss"].item(), LOSS_RTOL, f"step {t} aux_loss")
        else:
            assert "aux_loss" not in metrics, t
        if balance == "aux_free":
            for j, name in enumerate(bias_names):
                before = ctx.biases[j]
                want = before + MOE.bias_update_rate * torch.sign(load[j].mean() - load[j])
                assert torch.equal(state.params[name].detach(), want), (t, name, state.params[name], want)
                probs = ctx.logits[j].softmax(-1)
                seen["shifted"] += int((probs.topk(2, -1).indices.sort(-1).values
                                        != (probs + before).topk(2, -1).indices.sort(-1).values).any(-1).sum())

    def step(recorder):
        return make_train_step(model, inspect_grads=recorder, **optimizer_args())

    _steps_against_hand(model, step, params, make_ctx, steps=MOE_STEPS, micro_steps=2, grad_atol=MOE_GRAD_ATOL,
                        after_step=after_step)
    if balance == "aux_free":  # the bias moved and changed some token's experts
        assert seen["shifted"] > 0
    if balance == "aux":  # the balance loss's gradient is far above the norm's tolerance
        init = {n: init_slice(s, n, seed=0).requires_grad_(s.trainable) for n, s in model.specs.items()}
        batch = next(batches(1, 1))
        with_aux = _by_hand(model, init, batch, make_ctx(init))[1]
        without = _by_hand(model, init, batch, RouterLogits())[1]
        assert abs(with_aux - without) > 100 * NORM_RTOL * without, (with_aux, without)
