"""Multi-token prediction against a reference written here from transformers' own modules
(DeepseekV3ForCausalLM for the main model; its DeepseekV3DecoderLayer, DeepseekV3RMSNorm
and a Linear for the module, fed as DeepSeek-V3's paper and Megatron-Core's MTP do):
loss, mtp_loss and gradient norm per step equal (rtol 1e-5) training both the same way
from the same weights, read from a directory in the release's naming (the module as layer
n_layers, with copies of the embedding and the head). Export writes that naming and
imports back; a directory without the module's tensors starts it from the seed. One
process (eager and compiled) and pp 2. The depths' inputs and targets on their own."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from meshtrain.interop.hf import load_hf_params, read_hf_config, save_hf
from meshtrain.models.mtp import MtpConfig, mtp_rows
from support.deepseek import CFG, CLIP, MOE, MTP_CFG, STEPS, batches, hf_model, initial_params, moe_gates, \
    single_process, train_reference

transformers = pytest.importorskip("transformers")
modeling = pytest.importorskip("transformers.models.deepseek_v3.modeling_deepseek_v3")


class ReferenceMtp(torch.nn.Module):
    """One MTP module from transformers' parts: h' = layer(eh_proj([enorm(emb(t_{i+1})),
    hnorm(h_i)])), logits = lm_head(norm(h'))."""

    def __init__(self, config):
        super().__init__()
        d, eps = config.hidden_size, config.rms_norm_eps
        self.enorm, self.hnorm = modeling.DeepseekV3RMSNorm(d, eps), modeling.DeepseekV3RMSNorm(d, eps)
        self.eh_proj = torch.nn.Linear(2 * d, d, bias=False)
        self.layer = modeling.DeepseekV3DecoderLayer(config, layer_idx=config.num_hidden_layers)  # MoE, as V3's
        self.norm = modeling.DeepseekV3RMSNorm(d, eps)

    def forward(self, model, h, ahead):
        x = self.eh_proj(torch.cat([self.enorm(model.model.embed_tokens(ahead)), self.hnorm(h)], -1))
        positions = torch.arange(h.shape[1])[None]
        x = self.layer(x, position_embeddings=model.model.rotary_emb(x, positions), position_ids=positions)
        return model.lm_head(self.norm(x))


def _reference(seed: int = 0):
    model = hf_model(transformers, seed)
    torch.manual_seed(seed + 1)
    mtp = ReferenceMtp(model.config).float()
    with torch.no_grad():
        for name, p in mtp.named_parameters():
            if "experts." in name:  # created empty: transformers' model initialises its own
                p.normal_(0, model.config.initializer_range)
            p.add_(0.05 * torch.randn_like(p))
            if name.endswith("mlp.gate.weight"):
                p.mul_(20)
        mtp.layer.mlp.gate.e_score_correction_bias.copy_(0.1 * torch.randn(MOE.num_experts))
    return model, mtp


def _losses(model, mtp, tokens, targets):
    seen = {}
    hook = model.model.norm.register_forward_pre_hook(lambda m, args: seen.setdefault("h", args[0]))
    main = F.cross_entropy(model(tokens).logits.flatten(0, 1), targets.flatten())
    hook.remove()
    logits = mtp(model, seen["h"], targets)  # t_{i+1} is position i's target
    return main, F.cross_entropy(logits[:, :-1].flatten(0, 1), targets[:, 1:].flatten())


def _save_release(model, mtp, directory):
    """The directory a DeepSeek-V3 release is: transformers' files, config.json announcing
    one MTP layer, and layer n_layers's tensors with copies of the embedding and head."""
    model.save_pretrained(directory, save_original_format=False)  # experts fused, as the module's are
    path = directory / "model.safetensors"
    tensors = load_file(path)
    h = f"model.layers.{CFG.n_layers}."
    extra = {h + n: t for n, t in mtp.layer.state_dict().items()}
    extra |= {h + "enorm.weight": mtp.enorm.weight, h + "hnorm.weight": mtp.hnorm.weight,
              h + "eh_proj.weight": mtp.eh_proj.weight, h + "shared_head.norm.weight": mtp.norm.weight,
              h + "embed_tokens.weight": model.model.embed_tokens.weight,
              h + "shared_head.head.weight": model.lm_head.weight}
    save_file({**tensors, **{n: t.detach().contiguous() for n, t in extra.items()}}, path, metadata={"format": "pt"})
    config = (directory / "config.json").read_text().replace('"num_nextn_predict_layers": 0',
                                                             '"num_nextn_predict_layers": 1')
    (directory / "config.json").write_text(config)
    return directory


def _train_reference(model, mtp):
    """(main loss, MTP loss, grad norm) per step of the reference trained as our step trains
    (support/deepseek.py train_reference), the module's gate included."""
    steps = list(batches())

    def objective(t):
        main, extra = _losses(model, mtp, steps[t]["tokens"][0], steps[t]["targets"][0])
        return main + MTP_CFG.mtp.loss_coef * extra, (main.item(), extra.item())

    return train_reference(list(model.parameters()) + list(mtp.parameters()),
                           moe_gates([*model.model.layers, mtp.layer]), STEPS, objective)


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    model, mtp = _reference()
    return _save_release(model, mtp, tmp_path_factory.mktemp("release")), model, mtp


@pytest.mark.parametrize("compile", [False, "aot_eager"], ids=["eager", "compiled"])
def test_mtp_training_equals_the_reference(release, compile):
    directory, model, mtp = release
    fields = read_hf_config(directory)
    assert fields["mtp"] == {"depth": 1}
    params = load_hf_params(directory, "deepseek_v3", MTP_CFG)
    assert torch.equal(params["mtp.0.eh_proj"], mtp.eh_proj.weight)
    torch._dynamo.reset()
    metrics, final = single_process(params, compile=compile, cfg=MTP_CFG)
    model, mtp = _reference()  # fresh copies: the fixture's are the files'
    expected = _train_reference(model, mtp)
    got = [(m["loss"], m["mtp_loss"], m["grad_norm"]) for m in metrics]
    assert all(n > 1.5 * CLIP for *_, n in expected)  # clipping engages on every step
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=1e-5, atol=0)
    bias = mtp.layer.mlp.gate.e_score_correction_bias
    torch.testing.assert_close(final["mtp.0.moe.expert_bias"], bias, rtol=0, atol=1e-7)
    assert not torch.equal(bias, params["mtp.0.moe.expert_bias"])  # the module's bias moves too


def _pipeline_from(directory):
    """On each of 2 ranks: pp 2 with 1F1B over 4 micro-batches, the module on the last
    stage, from the release's weights; (loss, mtp_loss, grad_norm) per step."""
    from meshtrain import MeshSpec, Rules, TrainState, build, make_plan
    from meshtrain.pipeline.partition import partition
    from meshtrain.pipeline.schedule import build_pipeline_schedule
    from meshtrain.train.pipeline_step import local_stage_layout, make_pipeline_step
    from support.deepseek import BATCH, SEQ, optimizer_args

    torch.set_num_threads(1)
    model = build("deepseek_v3", MTP_CFG)
    plan = make_plan(model.specs, Rules.default(), MeshSpec(pp=2), world=2)
    mesh = plan.mesh.build()
    stages = partition(model, 2, seq_len=SEQ, micro_batch=BATCH // 4)
    mine, _, _ = local_stage_layout(plan, mesh, stages)
    full = load_hf_params(directory, "deepseek_v3", MTP_CFG)
    params = {n: full[n].clone().requires_grad_(model.specs[n].trainable) for n in mine}
    step = make_pipeline_step(model, stages, build_pipeline_schedule("1f1b", 2, 4), plan, mesh, **optimizer_args())
    state = TrainState.create(params)
    return [(m["loss"], m["mtp_loss"], m["grad_norm"]) for m in (step(state, b) for b in batches(4))]


def test_mtp_on_a_pipeline_equals_the_reference(release):
    """pp 2 (the module on the last stage, its embedding and head copies the stages'
    tied weights) trains as the reference does."""
    from meshtrain.testing import run_ranks

    directory, _, _ = release
    model, mtp = _reference()
    expected = torch.tensor(_train_reference(model, mtp))
    for got in run_ranks(_pipeline_from, 2, directory):
        torch.testing.assert_close(torch.tensor(got), expected, rtol=1e-5, atol=0)


def test_the_mtp_loss_changes_the_training():
    """Guards the test above: loss_coef 0 trains the main model alone, to other losses."""
    params = initial_params(MTP_CFG)
    with_mtp = single_process(params, cfg=MTP_CFG)[0]
    without = single_process(params, cfg=dataclasses.replace(MTP_CFG, mtp=MtpConfig(depth=1, loss_coef=0.0)))[0]
    assert with_mtp[0]["loss"] == without[0]["loss"]  # step 1: the same main loss
    assert abs(with_mtp[-1]["loss"] - without[-1]["loss"]) > 1e-4


def test_export_writes_the_release_naming_and_imports_back(tmp_path):
    params = initial_params(MTP_CFG)
    save_hf(params, "deepseek_v3", MTP_CFG, tmp_path, dtype="fp32")
    files = load_file(tmp_path / "model.safetensors")
    h = f"model.layers.{CFG.n_layers}."
    assert torch.equal(files[h + "embed_tokens.weight"], params["tok_emb"])
    assert torch.equal(files[h + "shared_head.head.weight"], params["output"])
    assert torch.equal(files[h + "mlp.experts.5.up_proj.weight"], params["mtp.0.moe.w_up"][5])
    assert torch.equal(files[h + "eh_proj.weight"], params["mtp.0.eh_proj"])
    back = load_hf_params(tmp_path, "deepseek_v3", MTP_CFG)
    assert back.keys() == params.keys() and all(torch.equal(back[n], params[n]) for n in params)
    # transformers loads the main model (it ignores the MTP layer's tensors)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert torch.equal(model.model.embed_tokens.weight, params["tok_emb"])


def test_a_release_without_the_module_starts_it_from_the_seed(tmp_path):
    model = hf_model(transformers)
    model.save_pretrained(tmp_path)
    config = (tmp_path / "config.json").read_text()
    (tmp_path / "config.json").write_text(config.replace('"num_nextn_predict_layers": 0', '"num_nextn_predict_layers": 1'))
    params = load_hf_params(tmp_path, "deepseek_v3", MTP_CFG)
    assert not any(n.startswith("mtp.") for n in params) and "tok_emb" in params


def test_depth_inputs_and_targets():
    tokens = torch.tensor([[10, 11, 12, 13, 14]])
    targets = torch.tensor([[11, 12, -1, 14, 15]])  # one target masked
    segments = torch.tensor([[0, 0, 0, 1, 1]])
    rows = mtp_rows(tokens, targets, 2)
    assert rows["mtp_tokens_1"].tolist() == [[11, 12, 13, 14, 15]]
    assert rows["mtp_targets_1"].tolist() == [[12, -1, 14, 15, -1]]
    assert rows["mtp_tokens_2"].tolist() == [[12, 13, 14, 15, 0]]
    assert rows["mtp_targets_2"].tolist() == [[-1, 14, 15, -1, -1]]
    split = mtp_rows(tokens, targets, 1, segments)  # position 2 (document 0) cannot predict 14 (document 1)
    assert split["mtp_targets_1"].tolist() == [[12, -1, -1, 15, -1]]


def test_tiny_deepseek_logs_mtp_loss(tmp_path):
    """configs/tiny-deepseek.yaml through the CLI: metrics.jsonl keeps loss as the
    next-token loss and adds mtp_loss."""
    from meshtrain.cli import main
    from support.cli import ROOT, read_metrics

    code = main(["fit", "--config", str(ROOT / "configs" / "tiny-deepseek.yaml"), "--run_dir", str(tmp_path / "run"),
                 "--train.steps", "2", "--train.global_batch", "4", "--train.micro_batch", "2", "--train.seq_len", "32",
                 "--train.log_every", "1", "--checkpoint.every", "0"])
    assert code == 0
    rows = read_metrics(tmp_path / "run")
    assert len(rows) == 2 and all(r["mtp_loss"] > 0 and r["loss"] > 0 for r in rows)
