"""Muon (train.optimizer muon) against torch.optim.Muon (fp32, gloo CPU ranks).

- The update's arithmetic: make_update with given gradients equals torch.optim.Muon (the
  blocks' matrices, each expert's matrix of a 3-D tensor on its own) + torch.optim.AdamW
  (the rest) + clip_grad_norm_ bit for bit, for both adjust_lr modes, with and without
  Nesterov.
- Training: transformers' LlamaForCausalLM trained that way from the same weights equals
  meshtrain's step: loss and gradient norm per step (rtol 1e-5) in one process (eager and
  inductor) and on fsdp2 x tp2+sp (eager and aot_eager), for both adjust_lr modes (and
  dp2 x fsdp2, replicas exchanging within their fsdp group).
- The layout suite against one process: DeepSeek-V3's experts (3-D, ep2 x tp2+sp, with
  MLA and an MTP module) and a pipeline (pp2 x fsdp2 x ep2).
- Muon(assemble="gather") (every rank orthogonalises every matrix) equals the default
  owners' exchange bit for bit on those layouts.
The 4-rank cases share one launch. The same against transformers through `meshtrain fit`
(config, data, metrics.jsonl): tests/test_muon_fit.py; their reference:
tests/support/muon.py.

Newton-Schulz runs in bf16 (as torch's): a gradient that differs in its last fp32 bit
(another reduction order: transformers' modules, a sharded reduction) can round to
another bf16 value, and the iteration carries that on. So the runs train at lr 3e-4 (as
tests/support/equivalence.py's AdamW). Measured (torch 2.13 CPU) against transformers:
losses within 2.9e-7, gradient norms within 4.4e-6 (one process under inductor,
match_rms_adamw; fsdp2 x tp2+sp 3.6e-6, dp2 x fsdp2 2.9e-6); DeepSeek's layouts against
one process within 8.7e-7.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from meshtrain import AdamW, LRSchedule, MeshSpec, Muon, Rules, TrainState, build, make_plan, make_train_step
from meshtrain.interop.hf import load_hf_params
from meshtrain.models.spec import init_slice
from meshtrain.parallel.init import init_params
from meshtrain.pipeline.partition import partition
from meshtrain.pipeline.schedule import build_pipeline_schedule
from meshtrain.testing import run_ranks
from meshtrain.train.pipeline_step import local_stage_layout, make_pipeline_step
from meshtrain.train.step import make_update
from support import deepseek
from support.equivalence import CFG, GRAD_CLIP, STEPS, batches
from support.muon import LR, WEIGHT_DECAY, hf_llama, torch_optimizers, train_reference

transformers = pytest.importorskip("transformers")

RTOL = 1e-5
ADJUST = ("original", "match_rms_adamw")


def muon_args(adjust: str, lr: float = LR, steps: int = STEPS, warmup: int = 3, clip: float = GRAD_CLIP,
              ns_dtype=torch.bfloat16, assemble="owner") -> dict:
    return dict(optimizer=Muon(AdamW(lr=lr, weight_decay=WEIGHT_DECAY), adjust_lr=adjust, ns_dtype=ns_dtype,
                               assemble=assemble),
                lr_schedule=LRSchedule(lr=lr, min_lr=lr / 10, warmup_steps=warmup, total_steps=steps), grad_clip=clip)


# --------------------------------------------------------------------------- the update itself

SHAPES = {"tok_emb": (11, 8), "layers.0.attn_norm": (8,), "layers.0.attn.wq": (8, 8), "layers.0.mlp.w_up": (20, 8),
          "layers.0.mlp.w_down": (8, 20), "layers.0.moe.router": (3, 8), "layers.0.moe.w_gate": (3, 6, 8),
          "mtp.0.eh_proj": (8, 16), "output": (11, 8)}


@pytest.mark.parametrize("adjust", ADJUST)
@pytest.mark.parametrize("nesterov", [True, False])
def test_update_equals_torch_bitwise(adjust, nesterov):
    g = torch.Generator().manual_seed(0)
    initial = {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}
    grads = [{n: torch.randn(s, generator=g) for n, s in SHAPES.items()} for _ in range(3)]
    opt = Muon(AdamW(lr=LR, weight_decay=WEIGHT_DECAY), adjust_lr=adjust, nesterov=nesterov)
    params = {n: p.clone().requires_grad_() for n, p in initial.items()}
    state = TrainState.create(params, opt)
    assert set(state.optimizer["momentum"]) == {n for n in SHAPES if n.startswith(("layers.", "mtp.")) and
                                                len(SHAPES[n]) >= 2 and not n.endswith("router")}
    assert set(state.optimizer["exp_avg"]) == set(SHAPES) - set(state.optimizer["momentum"])
    schedule = LRSchedule(lr=LR, min_lr=LR / 10, warmup_steps=1, total_steps=3)
    apply = make_update(opt, schedule, None)  # clipping's factor is rounded after another norm: see below
    # torch's: each expert of the 3-D tensor a matrix of its own
    theirs = {n: p.clone() for n, p in initial.items() if len(SHAPES[n]) < 3}
    theirs.update({f"layers.0.moe.w_gate.{e}": initial["layers.0.moe.w_gate"][e].clone() for e in range(3)})
    theirs = {n: p.requires_grad_() for n, p in theirs.items()}
    _, optimizers = torch_optimizers(theirs, adjust, nesterov)
    for t, step_grads in enumerate(grads):
        for n, p in params.items():
            p.grad = step_grads[n].clone()
        for n, p in theirs.items():
            base, _, e = n.rpartition(".") if n.startswith("layers.0.moe.w_gate.") else (n, "", "")
            p.grad = step_grads[base][int(e)].clone() if e else step_grads[n].clone()
        norm = float(apply(state)[0])
        assert norm == pytest.approx(float(torch.nn.utils.get_total_norm([p.grad for p in theirs.values()])), rel=1e-6)
        for o in optimizers:
            for group in o.param_groups:
                group["lr"] = schedule(t)
            o.step()
    for n, p in params.items():
        want = torch.stack([theirs[f"{n}.{e}"] for e in range(3)]) if p.ndim == 3 else theirs[n]
        if n in state.optimizer["momentum"]:  # Muon's: bit for bit
            assert torch.equal(p.detach(), want.detach()), n
        else:  # AdamW's, as tests/test_equivalence.py's test_clipped_update_equals_torch
            torch.testing.assert_close(p.detach(), want.detach(), rtol=0, atol=1e-7, msg=lambda m: f"{n}: {m}")
        assert not torch.equal(p.detach(), initial[n]), n


def test_adamw_state_is_made_over_before_the_first_step_and_refused_after():
    from meshtrain.errors import ConfigError

    params = {n: torch.randn(s).requires_grad_() for n, s in SHAPES.items()}
    opt = Muon(AdamW(lr=LR))
    apply = make_update(opt, LRSchedule(lr=LR, kind="constant"), None)
    state = TrainState.create(params)  # AdamW's moments, as before train.optimizer existed
    for p in params.values():
        p.grad = torch.ones_like(p)
    apply(state)
    assert "momentum" in state.optimizer and "layers.0.attn.wq" not in state.optimizer["exp_avg"]
    late = TrainState.create(params)
    late.step = 5
    for p in params.values():
        p.grad = torch.ones_like(p)
    with pytest.raises(ConfigError, match="train.optimizer=muon: this state holds AdamW's moments"):
        apply(late)


# --------------------------------------------------------------------------- training

def _numbers(metrics) -> list[tuple[float, float]]:
    return [(m["loss"], m["grad_norm"]) for m in metrics]


def _whole(params: dict) -> dict:
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in params.items()}


def llama_run(hf_dir, adjust: str, compile=False, sizes=None, sp=False, assemble="owner"):
    """Our llama from `hf_dir` trained with Muon: one process (sizes None) or a layout."""
    model = build("llama", CFG)
    if sizes is None:
        params = {n: p.requires_grad_() for n, p in load_hf_params(hf_dir, "llama", CFG).items()}
        step = make_train_step(model, compile=compile, **muon_args(adjust))
    else:
        plan = make_plan(model.specs, Rules.default(sp=sp), MeshSpec(**sizes), world=dist.get_world_size())
        mesh = plan.mesh.build()
        params = {n: p.requires_grad_() for n, p in load_hf_params(hf_dir, "llama", CFG, plan, mesh).items()}
        step = make_train_step(model, plan, mesh, compile=compile, **muon_args(adjust, assemble=assemble))
    state = TrainState.create(params, muon_args(adjust)["optimizer"])
    return _numbers([step(state, b) for b in batches(micro_steps=2 if sizes else 1)]), _whole(params)


# DeepSeek-V3 (support/deepseek.py): experts, MLA, routers, an MTP module.
DEEPSEEK = {"ep2_tp2_sp_mtp": ({"fsdp": 2, "tp": 2, "ep": 2}, True, None, "mtp"),
            "pp2_fsdp2_ep2_1f1b": ({"pp": 2, "fsdp": 2, "ep": 2}, False, "1f1b", "plain")}
DEEPSEEK_ADJUST = "match_rms_adamw"
NS_DTYPES = (torch.bfloat16, torch.float32)


def deepseek_args(ns_dtype, assemble="owner") -> dict:
    return muon_args(DEEPSEEK_ADJUST, deepseek.LR, deepseek.STEPS, deepseek.WARMUP, deepseek.CLIP, ns_dtype, assemble)


def deepseek_run(sizes=None, sp=False, schedule=None, variant="plain", ns_dtype=torch.bfloat16, assemble="owner"):
    """Our DeepSeek-V3 trained with Muon from seed 0: one process (sizes None) or a layout."""
    cfg = deepseek.MTP_CFG if variant == "mtp" else deepseek.CFG
    model = build("deepseek_v3", cfg)
    micro = 1
    if sizes is None:
        params = {n: init_slice(s, n, seed=0).requires_grad_(s.trainable) for n, s in model.specs.items()}
        step = make_train_step(model, **deepseek_args(ns_dtype))
    else:
        plan = make_plan(model.specs, Rules.default(sp=sp), MeshSpec(**sizes), world=dist.get_world_size())
        mesh = plan.mesh.build()
        if schedule is None:
            micro, params = 2, init_params(plan, mesh, seed=0)
            step = make_train_step(model, plan, mesh, **deepseek_args(ns_dtype, assemble))
        else:
            micro = 4
            stages = partition(model, sizes["pp"], seq_len=deepseek.SEQ, micro_batch=deepseek.BATCH // micro)
            mine, sub_plan, sub_mesh = local_stage_layout(plan, mesh, stages)
            params = init_params(sub_plan, sub_mesh, seed=0, names=mine)
            step = make_pipeline_step(model, stages, build_pipeline_schedule(schedule, sizes["pp"], micro), plan,
                                      mesh, **deepseek_args(ns_dtype, assemble))
    state = TrainState.create(params, deepseek_args(ns_dtype)["optimizer"])
    metrics = [step(state, b) for b in deepseek.batches(micro)]
    numbers = [(m["loss"], m["grad_norm"], *([m["mtp_loss"]] if "mtp_loss" in m else [])) for m in metrics]
    return numbers, _whole(params)


def _ranks(hf_dir):
    """Every 4-rank case, in one launch."""
    torch.set_num_threads(1)
    out = {}
    for adjust in ADJUST:
        for compile in (False, "aot_eager"):
            torch._dynamo.reset()
            out[f"fsdp2_tp2_sp_{adjust}_{compile or 'eager'}"] = llama_run(hf_dir, adjust, compile,
                                                                           {"fsdp": 2, "tp": 2}, True)
    out["dp2_fsdp2_original_eager"] = llama_run(hf_dir, "original", False, {"dp": 2, "fsdp": 2})  # replicas
    for name, case in DEEPSEEK.items():
        for dtype in NS_DTYPES:
            out[name, dtype] = deepseek_run(*case, ns_dtype=dtype)
    # Muon(assemble="gather"): every matrix gathered whole on every rank, bit for bit the same
    gather = {"fsdp2_tp2_sp": llama_run(hf_dir, "original", False, {"fsdp": 2, "tp": 2}, True, "gather")}
    gather.update({name: deepseek_run(*case, assemble="gather") for name, case in DEEPSEEK.items()})
    return out, gather


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama")
    hf_llama(transformers, CFG).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def references(hf_dir):
    windows = [(b["tokens"][0], b["targets"][0]) for b in batches(micro_steps=1)]
    return {adjust: train_reference(hf_llama(transformers, CFG), adjust, windows, muon_args(adjust)["lr_schedule"],
                                    GRAD_CLIP) for adjust in ADJUST}


def _check(got, want, what: str) -> None:
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=RTOL, atol=0,
                               msg=lambda m: f"{what} loss, grad norm: {m}")


@pytest.mark.parametrize("adjust", ADJUST)
@pytest.mark.parametrize("compile", [False, True], ids=["eager", "inductor"])
def test_one_process_equals_transformers_with_torch_muon(hf_dir, references, adjust, compile):
    torch._dynamo.reset()
    numbers, _ = llama_run(hf_dir, adjust, compile)
    assert all(norm > 1.5 * GRAD_CLIP for _, norm in references[adjust])  # clipping engages on every step
    _check(numbers, references[adjust], f"one process {adjust} compile={compile}")


@pytest.mark.slow
def test_layouts_equal_transformers_and_one_process(hf_dir, references):
    """Losses and norms against transformers (llama) or one process (DeepSeek-V3); the
    DeepSeek layouts' final parameters too, with Newton-Schulz in fp32 (measured at most
    6e-8 off one process; in bf16 2.6e-5, the rounding of near-ties carried on: their
    losses and norms stay within 8.3e-7)."""
    one = {(v, dtype): deepseek_run(variant=v, ns_dtype=dtype) for v in {c[-1] for c in DEEPSEEK.values()}
           for dtype in NS_DTYPES}
    results, gathers = zip(*run_ranks(_ranks, 4, str(hf_dir)))
    for rank_out, gather in zip(results, gathers):
        for name, (numbers, params) in gather.items():  # as the owners' runs, bit for bit
            numbers_, params_ = rank_out["fsdp2_tp2_sp_original_eager" if name == "fsdp2_tp2_sp" else
                                         (name, torch.bfloat16)]
            assert numbers == numbers_, name
            for n, p in params.items():
                assert torch.equal(p, params_[n]), (name, n)
        for name, (numbers, params) in rank_out.items():
            if isinstance(name, str):
                adjust = next(a for a in ADJUST if a in name)
                _check(numbers, references[adjust], name)
                continue
            want, want_params = one[DEEPSEEK[name[0]][-1], name[1]]
            _check(numbers, want, str(name))
            if name[1] == torch.float32:
                for n, p in params.items():
                    torch.testing.assert_close(p, want_params[n], rtol=0, atol=1e-5, msg=lambda m: f"{name} {n}: {m}")
    assert {n for n in results[0] if not isinstance(n, str)} == {(n, d) for n in DEEPSEEK for d in NS_DTYPES}


# --------------------------------------------------------------------------- the planner

@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_planned_optimizer_bytes_equal_the_state(optimizer):
    """The planner's optimizer state (estimate/memory.py) is the state TrainState keeps:
    Muon one fp32 buffer per matrix, AdamW two per other parameter."""
    from meshtrain.estimate.memory import per_rank_memory
    from meshtrain.train.config import TrainConfig
    from meshtrain.train.muon import optimizer_of

    cfg = deepseek.MTP_CFG
    model = build("deepseek_v3", cfg)
    plan = make_plan(model.specs, Rules.default(), MeshSpec(), world=1)
    planned = per_rank_memory(plan, model, micro_batch=2, seq_len=16, optimizer=optimizer)["optimizer"]
    state = TrainState.create({n: torch.empty(s.shape) for n, s in model.specs.items()},
                              optimizer_of(TrainConfig(optimizer=optimizer)))
    assert planned == sum(t.numel() * t.element_size() for g in state.optimizer.values() for t in g.values())


def test_plan_counts_muon():
    """`meshtrain plan` with train.optimizer muon: less optimizer memory, and the exchange
    of whole matrices (all-to-alls, assemble "owner")."""
    from meshtrain.config import RunConfig
    from meshtrain.estimate.dryrun import dry_run

    def run(optimizer):
        cfg = RunConfig.from_dict({"model": {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
                                             "ffn_dim": 128, "vocab_size": 264, "max_seq_len": 64},
                                   "parallel": {"fsdp": 2, "tp": 2, "sp": True},
                                   "train": {"seq_len": 64, "global_batch": 8, "micro_batch": 2,
                                             "optimizer": optimizer}})
        return dry_run(cfg.validate(), world=4)

    adamw, muon = run("adamw"), run("muon")
    assert muon.memory["optimizer"] < adamw.memory["optimizer"]
    exchanges = [e for e in muon.collectives if e["phase"] == "optimizer" and e["op"] == "all_to_all_single"]
    assert {e["axis"] for e in exchanges} == {"fsdp", "tp"}
    assert not [e for e in adamw.collectives if e["phase"] == "optimizer" and e["op"] != "all_reduce_sum"]
