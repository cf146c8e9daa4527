"""The deepseek_v3 family against transformers' DeepseekV3ForCausalLM (fp32): export loads
there with equal logits and imports back; a model transformers made and saved (the hub's
per-expert layout and the fused one) imports with equal logits; and training from its
weights with our step equals transformers' model trained with torch.optim.AdamW,
clip_grad_norm_ and the aux-free bias update, step by step, eager and compiled. The
router on its own; the config's refusals. The layouts: tests/test_deepseek_layouts.py."""

from __future__ import annotations

import contextlib
import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from meshtrain.config import ModelConfig, RunConfig
from meshtrain.errors import ConfigError
from meshtrain.interop.hf import load_hf_params, read_hf_config, save_hf
from meshtrain.models import LocalContext, build
from meshtrain.models.moe import route
from meshtrain.models.mtp import MtpConfig
from support.deepseek import CFG, CLIP, MOE, STEPS, batches, hf_model, initial_params, moe_gates, single_process, \
    train_reference

transformers = pytest.importorskip("transformers")
ATOL = 1e-5


def _perturbed(cfg=CFG, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random parameters with norms off their init, routers scaled up, an expert bias that
    moves choices (sigmoid scores lie in (0, 1)), and queries and keys large enough that
    the softmax's temperature (YaRN's) matters."""
    g = torch.Generator().manual_seed(seed + 1)
    out = {}
    for name, t in initial_params(cfg).items():
        if t.ndim == 1:
            t = t + (0.5 if name.endswith("expert_bias") else 0.2) * torch.randn(t.shape, generator=g)
        out[name] = t * 20 if name.endswith("moe.router") else t * 8 if name.endswith(("wq_b", "wq", "wkv_b")) else t
    return out


def _ours(cfg, params, tokens):
    with torch.no_grad():
        return build("deepseek_v3", cfg).forward(params, tokens, LocalContext())


def _tokens(seed: int = 0):
    return torch.randint(0, CFG.vocab_size, (2, 24), generator=torch.Generator().manual_seed(seed))


def _hf_load(directory):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32,
                                                                    output_loading_info=True)
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    return model.eval()


def _hf_logits(model, tokens):
    with torch.no_grad():
        return model(tokens).logits


def _imported(fields: dict):
    """The family config of imported model.* fields, with our test's training-only
    bias_update_rate (config.json has none)."""
    cfg = RunConfig(model=ModelConfig(**fields)).family_config()
    return dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, bias_update_rate=MOE.bias_update_rate))


NO_Q_LORA = dataclasses.replace(CFG, mla=dataclasses.replace(CFG.mla, q_lora_rank=None), rope_scaling=None)


@pytest.mark.parametrize("cfg", [CFG, NO_Q_LORA], ids=["q_lora_yarn", "no_q_lora"])
def test_export_loads_in_transformers_and_imports_back(tmp_path, cfg):
    params = _perturbed(cfg)
    save_hf(params, "deepseek_v3", cfg, tmp_path, dtype="fp32")
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["DeepseekV3ForCausalLM"] and config["first_k_dense_replace"] == 1
    assert (config["n_group"], config["topk_group"], config["q_lora_rank"]) == (4, 2, cfg.mla.q_lora_rank)
    files = load_file(tmp_path / "model.safetensors")
    assert torch.equal(files["model.layers.1.mlp.experts.3.down_proj.weight"], params["layers.1.moe.w_down"][3])
    assert torch.equal(files["model.layers.1.mlp.gate.e_score_correction_bias"], params["layers.1.moe.expert_bias"])
    model = _hf_load(tmp_path)
    tokens = _tokens()
    ours = _ours(cfg, params, tokens)
    diff = (_hf_logits(model, tokens) - ours).abs().max().item()
    assert diff < ATOL, f"max |logit difference| {diff}"
    # What the comparison sees: the expert bias, YaRN's query gain and the groups all
    # change the logits by far more than the tolerance.
    changed = [({**params, "layers.1.moe.expert_bias": params["layers.1.moe.expert_bias"].flip(0)}, cfg)]
    if cfg.rope_scaling:
        changed.append((params, dataclasses.replace(cfg, rope_scaling={**cfg.rope_scaling, "mscale_all_dim": 0.0})))
    changed.append((params, dataclasses.replace(cfg, moe=dataclasses.replace(MOE, groups=1, group_top_k=1))))
    for p, c in changed:
        assert (_ours(c, p, tokens) - ours).abs().max() > 100 * ATOL, c
    back = load_hf_params(tmp_path, "deepseek_v3", cfg)
    assert back.keys() == params.keys() and all(torch.equal(back[n], params[n]) for n in params)
    assert _imported(read_hf_config(tmp_path)) == cfg


def test_import_from_transformers_both_expert_layouts(tmp_path):
    model = hf_model(transformers).eval()
    tokens = _tokens(1)
    expected = _hf_logits(model, tokens)
    model.save_pretrained(tmp_path / "hub")
    model.save_pretrained(tmp_path / "fused", save_original_format=False)
    assert "model.layers.1.mlp.experts.7.up_proj.weight" in load_file(tmp_path / "hub" / "model.safetensors")
    assert "model.layers.1.mlp.experts.gate_up_proj" in load_file(tmp_path / "fused" / "model.safetensors")
    cfg = _imported(read_hf_config(tmp_path / "hub"))
    assert cfg == CFG
    params = load_hf_params(tmp_path / "hub", "deepseek_v3", cfg)
    diff = (_ours(cfg, params, tokens) - expected).abs().max().item()
    assert diff < ATOL, f"max |logit difference| {diff}"
    fused = load_hf_params(tmp_path / "fused", "deepseek_v3", cfg)
    assert all(torch.equal(fused[n], params[n]) for n in params)


def test_router_equals_transformers():
    """Group-limited selection on biased sigmoid scores, gates from the unbiased ones."""
    model = hf_model(transformers)
    gate = model.model.layers[1].mlp.gate
    h = torch.randn(256, CFG.dim, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits, weights, idx = gate(h)
        ours_idx, ours_gates, _ = route(F.linear(h, gate.weight), MOE, gate.e_score_correction_bias)
    order, ours_order = idx.sort(-1), ours_idx.sort(-1)
    assert torch.equal(order.values, ours_order.values)
    torch.testing.assert_close(ours_gates.gather(-1, ours_order.indices), weights.gather(-1, order.indices))
    plain, _, _ = route(F.linear(h, gate.weight), dataclasses.replace(MOE, groups=1, group_top_k=1),
                        gate.e_score_correction_bias)
    assert not torch.equal(plain.sort(-1).values, order.values)  # the groups change some tokens' experts


def _train_transformers(model):
    """transformers' model trained as our step trains (support/deepseek.py
    train_reference) on the test's batches: (losses, grad norms)."""
    model.train()
    steps = list(batches())

    def objective(t):
        loss = F.cross_entropy(model(steps[t]["tokens"][0]).logits.flatten(0, 1), steps[t]["targets"][0].flatten())
        return loss, (loss.item(),)

    out = train_reference(list(model.parameters()), moe_gates(model.model.layers), STEPS, objective)
    return [loss for loss, _ in out], [norm for _, norm in out]


@pytest.mark.parametrize("compile", [False, "aot_eager"], ids=["eager", "compiled"])
def test_training_equals_transformers(tmp_path, compile):
    model = hf_model(transformers)
    model.save_pretrained(tmp_path)
    params = load_hf_params(tmp_path, "deepseek_v3", CFG)
    torch._dynamo.reset()
    metrics, final = single_process(params, compile=compile)
    losses, norms = _train_transformers(model)
    assert all(n > 1.5 * CLIP for n in norms)  # clipping engages: a wrong norm scales every update
    torch.testing.assert_close(torch.tensor([m["loss"] for m in metrics]), torch.tensor(losses), rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.tensor([m["grad_norm"] for m in metrics]), torch.tensor(norms), rtol=1e-5, atol=0)
    bias = model.model.layers[1].mlp.gate.e_score_correction_bias
    torch.testing.assert_close(final["layers.1.moe.expert_bias"], bias, rtol=0, atol=1e-7)
    assert not torch.equal(bias, params["layers.1.moe.expert_bias"])
    for n, theirs in load_hf_params(_saved(model, tmp_path / "after"), "deepseek_v3", CFG).items():
        torch.testing.assert_close(final[n], theirs, rtol=0, atol=1e-5, msg=lambda m: f"{n}: {m}")


def _saved(model, directory):
    model.save_pretrained(directory)
    return directory


@pytest.mark.parametrize("changes, fragment", [
    (dict(mla=None), "model.mla is null"),
    (dict(n_kv_heads=2), "model.n_kv_heads=2: model.arch=deepseek_v3"),
    (dict(rope_scaling={"type": "yarn", "factor": 4.0}), "model.rope_scaling="),
    (dict(mla={"qk_rope_head_dim": 5}), "model.mla.qk_rope_head_dim=5 is odd"),
    (dict(moe={"num_experts": 8, "groups": 3}), "model.moe.groups=3 must split"),
    (dict(moe={"num_experts": 8, "top_k": 4, "groups": 4, "group_top_k": 1}), "model.moe.group_top_k=1 groups of 2"),
    (dict(arch="llama", n_kv_heads=4), "model.mla="),
])
def test_config_refusals_name_the_key(changes, fragment):
    base = dict(arch="deepseek_v3", n_kv_heads=None, mla={})
    with pytest.raises(ConfigError, match=fragment.replace("(", r"\(").replace("[", r"\[")):
        ModelConfig(**{**base, **changes}).check()


def test_the_671b_preset_counts_as_published():
    """DeepSeek-V3's report: 671B parameters, 37B activated per token; the Hugging Face
    release: 685B with the MTP module's 14B (its block, projection and norms, and its
    copies of the embedding and head)."""
    import yaml
    from meshtrain.models.deepseek_v3 import PRESETS
    from support.cli import ROOT

    preset = RunConfig.from_dict(yaml.safe_load((ROOT / "configs" / "deepseek-v3-671b.yaml").read_text()))
    assert preset.validate().family_config() == PRESETS["deepseek-v3-671b"]
    specs = build("deepseek_v3", PRESETS["deepseek-v3-671b"]).specs
    main = {n: s.numel for n, s in specs.items() if not n.startswith("mtp.")}
    routed = sum(s.numel for n, s in specs.items() if "experts" in s.axes and n in main)
    assert sum(main.values()) / 1e9 == pytest.approx(671.03, abs=0.01)
    assert (sum(main.values()) - routed * 248 / 256) / 1e9 == pytest.approx(37.55, abs=0.01)
    mtp = sum(s.numel for n, s in specs.items() if n.startswith("mtp."))
    assert (mtp + 2 * 129280 * 7168) / 1e9 == pytest.approx(13.5, abs=0.05)  # the release's "14B"


def test_flops_per_token_counts_mla_and_mtp_heads():
    """6 x the matmul weights a token uses (top_k of the experts, the head once more per MTP
    depth) + 3 x 2 x keys x heads x (qk + v head dims) per block, MTP's included."""
    from meshtrain.train.metrics import flops_per_token

    for cfg in (CFG, dataclasses.replace(CFG, mtp=MtpConfig(depth=2))):
        specs = build("deepseek_v3", cfg).specs
        matrices = sum(s.numel for n, s in specs.items() if len(s.shape) == 2 and n != "tok_emb")
        experts = sum(s.numel for s in specs.values() if len(s.shape) == 3)
        blocks = cfg.n_layers + cfg.mtp.depth
        matmul = matrices + experts * MOE.top_k / MOE.num_experts + cfg.mtp.depth * specs["output"].numel
        attention = 6 * 16 * cfg.n_heads * (cfg.mla.qk_head_dim + cfg.mla.v_head_dim) * blocks
        assert flops_per_token(build("deepseek_v3", cfg), 16) == pytest.approx(6 * matmul + attention, rel=1e-12)


def test_greedy_decoding_with_the_latent_cache_equals_transformers(tmp_path):
    """The cache holds each position's latent and rotary key (kv_lora_rank + rope dims, not
    heads x (qk + v) dims); greedy generation equals transformers' generate."""
    from meshtrain.generate import generate
    from meshtrain.models.deepseek_v3 import init_cache

    model = hf_model(transformers).eval()
    model.save_pretrained(tmp_path)
    params = load_hf_params(tmp_path, "deepseek_v3", CFG)
    cache = init_cache(CFG, 1, 8)
    assert cache.k[0].shape == (1, 8, 1, CFG.mla.kv_lora_rank) and cache.v[0].shape == (1, 8, 1, 4)
    ids = _tokens(5)[0, :7].tolist()
    with torch.no_grad():
        theirs = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, min_new_tokens=12,
                                pad_token_id=0)[0, len(ids):].tolist()
    assert generate(params, "deepseek_v3", CFG, ids, 12, temperature=0) == theirs


# --- precision: a run that learns (the next token is this one + 1), with an MTP module --------

PRECISION_STEPS = 6
# Measured (this CPU, torch 2.13) as the largest |loss - fp32 loss| / fp32 loss over 6 steps,
# the loss and mtp_loss alike: bf16 1.7e-4, fp8 tensorwise 6.1e-4; a bf16 run at lr 0 sits
# 0.17 from the fp32 curve, which falls 15% (0.73). Tolerances 3-6x the measured.
DEEPSEEK_BF16_RTOL, DEEPSEEK_FP8_RTOL = 1e-3, 2e-3


def _precision_run(precision: str, lr: float = 3e-3):
    from meshtrain import AdamW, LRSchedule, TrainState, make_train_step
    from meshtrain.models.spec import init_slice
    from support.deepseek import BATCH, MTP_CFG, SEQ
    from support.precision import ComputeDtypes

    model = build("deepseek_v3", MTP_CFG)
    params = {n: init_slice(s, n, seed=0).requires_grad_(s.trainable) for n, s in model.specs.items()}
    step = make_train_step(model, precision=precision, optimizer=AdamW(lr=lr, weight_decay=0.1), grad_clip=1.0,
                           lr_schedule=LRSchedule(lr=lr, min_lr=lr / 10, warmup_steps=2, total_steps=PRECISION_STEPS))
    state, recorder, out = TrainState.create(params), ComputeDtypes(), []
    g = torch.Generator().manual_seed(1234)
    for i in range(PRECISION_STEPS):
        t = (torch.randint(0, MTP_CFG.vocab_size, (BATCH, 1), generator=g) + torch.arange(SEQ + 1)) % MTP_CFG.vocab_size
        batch = {"tokens": t[None, :, :-1], "targets": t[None, :, 1:]}
        with recorder if i == 0 else contextlib.nullcontext():
            m = step(state, batch)
        out.append((m["loss"], m["mtp_loss"]))
    return torch.tensor(out), recorder.ops


def test_bf16_and_fp8_track_fp32_and_fp8_runs_the_projections_on_scaled_mm():
    """fp8 GEMMs for every projection the precision policy gives them: MLA's five, the dense
    MLP's three, the shared expert's three, MTP's eh_proj (the router, the head and the
    grouped routed experts stay bf16): 25 linears, each a forward and two backward GEMMs."""
    fp32, _ = _precision_run("fp32")
    assert fp32[0, 0] - fp32[-1, 0] > 0.5  # the reference learns
    for precision, rtol in (("bf16", DEEPSEEK_BF16_RTOL), ("fp8", DEEPSEEK_FP8_RTOL)):
        got, ops = _precision_run(precision)
        torch.testing.assert_close(got, fp32, rtol=rtol, atol=0, msg=lambda m: f"{precision}: {m}")
        assert not torch.equal(got, fp32)
        scaled = {k[1][:2]: v for k, v in ops.items() if k[0] == "_scaled_mm"}
        assert scaled == ({} if precision == "bf16" else {("float8_e4m3fn", "float8_e4m3fn"): 25,
                                                          ("float8_e5m2", "float8_e4m3fn"): 50}), scaled
    frozen, _ = _precision_run("bf16", lr=0.0)  # the tolerances catch a run that does not train
    assert ((frozen - fp32).abs() / fp32).max() > 50 * DEEPSEEK_FP8_RTOL
