"""The deepseek_v3 family's config, its presets, and how the run config's model.* section
maps onto it."""

from __future__ import annotations

from dataclasses import dataclass, field

from ...errors import ConfigError, check_float, check_int
from ..layers import yarn_mscale
from ..mla import MlaConfig
from ..moe import MoeConfig
from ..mtp import MtpConfig


@dataclass(frozen=True)
class DeepseekV3Config:
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 8
    ffn_dim: int = 688
    vocab_size: int = 512
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    rope_scaling: dict | None = field(default=None, hash=False)  # None or YaRN (YARN_KEYS)
    norm_eps: float = 1e-6
    tie_embeddings: bool = False
    init_std: float = 0.02
    moe: MoeConfig | None = None
    mla: MlaConfig = MlaConfig()
    mtp: MtpConfig = MtpConfig()

    @property
    def head_dim(self) -> int:
        """A query/key head's width (nope + rope dims); values are mla.v_head_dim wide."""
        return self.mla.qk_head_dim

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return self.moe.moe_layers(self.n_layers) if self.moe else ()

    @property
    def q_gain(self) -> float:
        """What the queries are multiplied by beyond 1/sqrt(qk head dim): YaRN's mscale_all_dim
        term squared (DeepSeek-V3 at 128K: 1.874^2), 1 without YaRN."""
        s = self.rope_scaling
        return yarn_mscale(s["factor"], s["mscale_all_dim"]) ** 2 if s and s["mscale_all_dim"] else 1.0


YARN_KEYS = ("type", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
             "mscale_all_dim")

# DeepSeek-V3 (and R1, V3.1: the same architecture), as its config.json says.
DEEPSEEK_V3_671B = DeepseekV3Config(
    dim=7168, n_layers=61, n_heads=128, ffn_dim=18432, vocab_size=129280, max_seq_len=163840, rope_theta=10000.0,
    rope_scaling={"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
                  "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
    moe=MoeConfig(num_experts=256, top_k=8, expert_ffn_dim=2048, shared_experts=1, router="sigmoid",
                  balance="aux_free", aux_coef=0.0, layers="3:", norm_topk=True, route_scale=2.5, groups=8,
                  group_top_k=4),
    mla=MlaConfig(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128),
    mtp=MtpConfig(depth=1, loss_coef=0.3))

PRESETS: dict[str, DeepseekV3Config] = {"tiny": DeepseekV3Config(), "deepseek-v3-671b": DEEPSEEK_V3_671B}


def from_fields(m) -> DeepseekV3Config:
    """The DeepseekV3Config of a model.* section (models/config.py ModelConfig)."""
    return DeepseekV3Config(dim=m.dim, n_layers=m.n_layers, n_heads=m.n_heads, ffn_dim=m.ffn_dim,
                            vocab_size=m.vocab_size, max_seq_len=m.max_seq_len, rope_theta=m.rope_theta,
                            rope_scaling=m.rope_scaling, norm_eps=m.norm_eps, tie_embeddings=m.tie_embeddings,
                            moe=m.moe, mla=m.mla, mtp=m.mtp or MtpConfig())


def check_fields(m) -> None:
    """The model.* keys deepseek_v3 reads: model.mla (its attention), RoPE with YaRN or
    none, an explicit dense MLP size; and none of llama's GQA, q/k norms or head_dim."""
    if m.mla is None:
        raise ConfigError("model.mla is null, but model.arch=deepseek_v3 attends with multi-head latent attention: "
                          "set model.mla (DeepSeek-V3: {q_lora_rank: 1536, kv_lora_rank: 512, qk_nope_head_dim: "
                          "128, qk_rope_head_dim: 64, v_head_dim: 128})")
    if m.n_kv_heads is not None and m.n_kv_heads != m.n_heads:
        raise ConfigError(f"model.n_kv_heads={m.n_kv_heads}: model.arch=deepseek_v3 shares one latent among all "
                          f"heads, not kv head groups; set model.n_kv_heads null (or to model.n_heads={m.n_heads})")
    for key, value in (("qk_norm", m.qk_norm or None), ("head_dim", m.head_dim)):
        if value is not None:
            raise ConfigError(f"model.{key}={value!r}: model.arch=deepseek_v3 sizes its heads in model.mla; set "
                              f"model.{key} {'false' if key == 'qk_norm' else 'null'}")
    if m.ffn_dim is None:
        raise ConfigError("model.ffn_dim is null, but deepseek_v3's dense blocks need an MLP size: set model.ffn_dim "
                          "(DeepSeek-V3: 18432)")
    if m.rope_theta is None:
        raise ConfigError("model.rope_theta is null, but deepseek_v3 uses RoPE: set model.rope_theta (DeepSeek-V3: "
                          "10000.0)")
    check_float(m.rope_theta, "model.rope_theta", positive=True)
    if m.rope_scaling is not None:
        check_yarn(m.rope_scaling)


def check_yarn(s) -> None:
    """model.rope_scaling for deepseek_v3: YaRN with exactly YARN_KEYS."""
    if not isinstance(s, dict) or set(s) != set(YARN_KEYS) or s.get("type") != "yarn":
        raise ConfigError(f"model.rope_scaling={s!r}: give null, or (deepseek_v3) YaRN as a mapping with exactly the "
                          f"keys {', '.join(YARN_KEYS)} and type yarn (DeepSeek-V3: factor 40, "
                          "original_max_position_embeddings 4096, beta_fast 32, beta_slow 1, mscale 1, "
                          "mscale_all_dim 1)")
    for key in ("factor", "beta_fast", "beta_slow"):
        check_float(s[key], f"model.rope_scaling.{key}", positive=True)
    for key in ("mscale", "mscale_all_dim"):
        check_float(s[key], f"model.rope_scaling.{key}", minimum=0.0)
    check_int(s["original_max_position_embeddings"], "model.rope_scaling.original_max_position_embeddings", 1)
    if s["factor"] < 1:
        raise ConfigError(f"model.rope_scaling.factor={s['factor']} must be at least 1 (it stretches the context "
                          "by this factor, e.g. 40)")
    if s["beta_slow"] >= s["beta_fast"]:
        raise ConfigError(f"model.rope_scaling.beta_slow={s['beta_slow']} must be below beta_fast={s['beta_fast']} "
                          "(frequencies turning between them are blended; DeepSeek-V3: 1 and 32)")
