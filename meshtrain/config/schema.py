"""The run configuration: what `meshtrain fit` reads from YAML and the command line.

Every field has an attribute docstring (jsonargparse shows it in --help). `validate()`
raises ConfigError naming the key and the fix for any value that cannot work, and for
any feature the keys already name but that is not implemented yet: nothing is accepted
and then silently ignored.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from ..errors import ConfigError
from ..pipeline.schedule import PP_SCHEDULES

PRECISIONS = ("fp32", "bf16", "fp8")
FP8_RECIPES = ("tensorwise", "rowwise")
CHECKPOINTING = ("none", "selective", "full")
NONFINITE = ("abort", "skip")
BYTES_VOCAB = 258  # the bytes tokenizer: 256 byte values, BOS and EOS
# Upper bounds of the model sizes: far above any real model (Llama 3 405B: dim 16384, 126
# layers, ffn_dim 53248, 128 heads, vocabulary 128256; DeepSeek-V3: 256 experts), low enough
# that a typo fails here, not as an allocation, an overflow or an endless planning loop
# after the ranks have started. The vocabulary bound is the int32 token id.
MAX_SIZES = {"model.dim": 2**20, "model.n_layers": 1024, "model.n_heads": 2**16, "model.n_kv_heads": 2**16,
             "model.ffn_dim": 2**22, "model.head_dim": 2**16, "model.vocab_size": 2**31 - 1,
             "model.max_seq_len": 2**24, "model.moe.num_experts": 2**16, "model.moe.shared_experts": 2**16,
             "model.moe.expert_ffn_dim": 2**22}
MAX_STEPS = 10**12  # a million times the longest pre-training runs
MAX_TIMEOUT_S = 1.0e8  # about 3 years: a process group's timeout must fit a timedelta and int64 milliseconds


@dataclass
class MoeSection:
    """Mixture-of-experts feed-forward blocks (llama family): a router picks top_k of num_experts SwiGLU experts per token."""

    num_experts: int = 8
    """Routed experts per MoE block."""
    top_k: int = 2
    """Experts each token is sent to."""
    expert_ffn_dim: int = 128
    """Hidden size of each expert's SwiGLU."""
    shared_experts: int = 0
    """Experts every token also passes through (DeepSeek-style), run as one SwiGLU of shared_experts x expert_ffn_dim; 0: none."""
    router: str = "softmax"
    """softmax (Mixtral, Qwen3-MoE) | sigmoid (DeepSeek-V3: independent scores, the chosen ones normalised). Computed in fp32."""
    balance: str = "aux"
    """aux: a balance loss aux_coef x E/k x sum_i f_i P_i, taken within each sequence and averaged over the global batch | aux_free: a per-expert bias shifts the choice of experts toward balance, updated after each step by bias_update_rate x sign(mean load - load) over the global batch's tokens | none."""
    aux_coef: float = 0.01
    """Weight of the balance loss (balance aux)."""
    z_loss_coef: float = 0.0
    """Weight of the router z-loss (mean over tokens of logsumexp(logits)^2); 0: off."""
    capacity_factor: float | None = None
    """null: dropless (every routed token is computed). A number: each expert takes at most ceil(capacity_factor x tokens x top_k / E) of each rank's routed tokens per micro-step, those with the highest gates; the rest are dropped (they add nothing; the residual carries them)."""
    layers: str | list[int] = "all"
    """Which blocks are MoE: all; a slice such as '1:' (all but the first, dense, block) or '::2'; or a list of indices. Dense blocks keep model.ffn_dim."""
    norm_topk: bool = True
    """Normalise the top_k gates of a token to sum to 1."""
    route_scale: float = 1.0
    """Multiplier of the gates (DeepSeek-V3: 2.5)."""
    bias_update_rate: float = 0.001
    """Step of the aux-free bias update (balance aux_free)."""

    def __post_init__(self):
        # `--model.moe.layers "'1:'"`: the command line keeps a quoted string's quotes.
        v = self.layers
        if isinstance(v, str) and len(v) > 1 and v[0] == v[-1] and v[0] in "'\"":
            self.layers = v[1:-1]


@dataclass
class ModelConfig:
    """The model architecture."""

    arch: str = "llama"
    """Model family: llama, or gpt2."""
    dim: int = 256
    """Width of the residual stream (hidden size)."""
    n_layers: int = 4
    """Number of transformer blocks (at most 1024)."""
    n_heads: int = 8
    """Number of attention (query) heads; must divide dim."""
    n_kv_heads: int | None = 4
    """Number of key/value heads (grouped-query attention; llama only). Must divide n_heads. null: as many as n_heads. gpt2 has no GQA: leave it null or equal to n_heads."""
    ffn_dim: int | None = 688
    """Hidden size of the MLP. null: 4 * dim (gpt2 only; llama needs a value)."""
    vocab_size: int = 512
    """Rows of the embedding and output tables; at least the tokenizer's vocabulary (256 for bytes)."""
    max_seq_len: int = 256
    """Longest sequence the model supports (gpt2: rows of the learned position table); train.seq_len may not exceed it."""
    rope_theta: float | None = 10000.0
    """RoPE base frequency (llama only; gpt2 uses learned positions: leave it null)."""
    norm_eps: float = 1.0e-5
    """Epsilon of RMSNorm (llama) or LayerNorm (gpt2)."""
    tie_embeddings: bool = False
    """Share the token embedding table with the output projection."""
    init_from: str | None = None
    """Start from Hugging Face weights: a directory with config.json and *.safetensors (Llama or GPT-2). Its architecture must match the model.* keys; each rank reads only the slices of its own shards. Ignored when resuming from a checkpoint. null: random initialisation from seed."""
    rope_scaling: dict | None = None
    """Llama 3.1-style RoPE rescaling for long context (llama only): {factor, low_freq_factor, high_freq_factor, original_max_position_embeddings} with factor >= 1, low_freq_factor < high_freq_factor and an integer original_max_position_embeddings; null: none."""
    qk_norm: bool = False
    """RMSNorm on each query and key head before RoPE (Qwen3; llama only)."""
    head_dim: int | None = None
    """Width of an attention head when it is not dim / n_heads (Qwen3; llama only); null: dim / n_heads."""
    moe: MoeSection | None = None
    """Mixture-of-experts blocks (llama only); null: every block is dense."""


@dataclass
class ParallelConfig:
    """How the ranks are laid out. The mesh axes (dp, fsdp, tp, cp, ep, pp) must multiply to the number of ranks; one of them may be -1 to take the remaining ranks."""

    nproc_per_node: int = 1
    """Processes per node. Run without a launcher, meshtrain fit starts this many ranks itself (torch.distributed's elastic agent, one node). Under torchrun (or any launcher setting RANK/WORLD_SIZE) the launcher's world is used, and this must be 1 or match the launcher's --nproc_per_node."""
    dp: int = 1
    """Replicated data parallelism (DDP-style: parameters and optimizer state replicated)."""
    fsdp: int = -1
    """Fully sharded data parallelism (ZeRO-3 style: parameters, gradients and optimizer state sharded). -1: the remaining ranks."""
    tp: int = 1
    """Tensor parallelism (Megatron-style: heads, MLP and vocab split); must divide n_heads, n_kv_heads, ffn_dim and vocab_size."""
    sp: bool = False
    """Sequence parallelism: shard the residual stream's sequence dim over the tp ranks (train.seq_len must be divisible by tp)."""
    cp: int = 1
    """Context parallelism: every activation's sequence dim split over cp ranks in load-balanced zigzag order (rank r holds chunks r and 2cp-1-r of 2cp); train.seq_len must be a multiple of 2 x cp. Parameters are fsdp-sharded over fsdp x cp. train.compile works with cp as the only parallel axis."""
    cp_comm: str = "allgather"
    """How attention exchanges the sequence over cp: allgather (K/V all-gathered; any head count) | ring (K/V blocks passed around the cp ranks point to point, overlapped with compute) | a2a (Ulysses all-to-all to a head split; n_heads and n_kv_heads per tp rank must divide by cp)."""
    ep: int = 1
    """Expert parallelism (needs model.moe): each expert's weights live on one of ep ranks, drawn from the fsdp x cp ranks (folded, so ep is not a factor of the world size and must divide fsdp x cp); tokens reach their experts by all-to-all. Expert weights are fsdp-sharded over the fsdp x cp / ep ranks left and split over tp on their hidden dim. Eager only (train.compile false)."""
    pp: int = 1
    """Pipeline parallelism: the layers split into pp x pp_virtual stages over pp groups of ranks (outermost mesh axis). The micro-batches of a step (global_batch / (micro_batch x dp x fsdp)) flow through the stages; eager (train.compile false)."""
    pp_schedule: str = "1f1b"
    """Pipeline schedule: gpipe | 1f1b | interleaved (needs pp_virtual >= 2 and a micro-batch count divisible by pp) | zb (zero-bubble ZB-H1: backward split into input and weight gradients)."""
    pp_virtual: int = 1
    """Stages per pp rank (interleaved schedule: rank r holds stages r, r + pp, ...); 1 without a pipeline (pp 1)."""
    pp_layout: list[int] | None = None
    """Layers per stage, e.g. [3, 2] for 5 layers on 2 stages; null: balanced by a cost model (FLOPs of layers, embedding and head/loss)."""
    collective_timeout_s: float = 900.0
    """Seconds a collective may wait for its peers before it fails (the process group's timeout; at most 1e8)."""
    watchdog_s: float = 600.0
    """Seconds a rank may go without progress (a step, an evaluation, a checkpoint) before the watchdog names the stalled rank, its step and operation, and ends the job; 0: off. Must be below collective_timeout_s so its report comes first; raise it above your slowest step (the first one compiles)."""


@dataclass
class TrainConfig:
    """The optimisation loop."""

    steps: int = 100
    """Optimizer steps to run."""
    global_batch: int = 16
    """Sequences per optimizer step, over all ranks and micro-steps."""
    micro_batch: int = 4
    """Sequences per data-parallel rank per micro-step. Gradient accumulation steps = global_batch / (micro_batch * dp * fsdp)."""
    seq_len: int = 128
    """Tokens per training sequence (at most model.max_seq_len)."""
    lr: float = 3.0e-4
    """Peak learning rate (AdamW, betas 0.9/0.95, eps 1e-8)."""
    min_lr: float = 3.0e-5
    """Learning rate at the end of the decay."""
    warmup_steps: int = 10
    """Steps of linear warmup from lr/warmup_steps to lr (a run shorter than its warmup ends inside it)."""
    lr_schedule: str = "cosine"
    """Decay after warmup: cosine, linear, wsd (warmup-stable-decay, last 20% decays) or constant."""
    weight_decay: float = 0.1
    """Decoupled AdamW weight decay, applied to matrices only (not to norms or biases)."""
    grad_clip: float | None = 1.0
    """Clip the global gradient norm to this value; 0 or null: no clipping."""
    precision: str = "fp32"
    """Compute precision: fp32; bf16; or fp8 (bf16, with the GEMMs of every linear except the embedding, head and MoE router in fp8, dynamically scaled). Parameters, gradients and optimizer state stay fp32."""
    fp8_recipe: str = "tensorwise"
    """Scaling of the fp8 GEMMs (train.precision fp8): tensorwise (one scale per tensor) or rowwise (one per row along the contracted dim)."""
    compile: bool = False
    """Compile the loss and the optimizer update with torch.compile (inductor, fullgraph)."""
    activation_checkpointing: str = "none"
    """Recompute activations in backward to save memory: none; selective (keep matmul and attention outputs, recompute norms, activations and the rest); full (keep only each block's input, recompute the block)."""
    log_every: int = 1
    """Log step, loss, lr, grad_norm and tokens/s every this many steps (and at the last step)."""
    eval_every: int = 0
    """Evaluate the validation loss and perplexity every this many steps (and at the last step); 0: never. Needs data.valid_fraction > 0."""
    eval_batches: int = 2
    """Global batches of validation data per evaluation: always the same first samples of the validation split."""
    nonfinite: str = "abort"
    """A step whose loss or gradient norm is not finite never updates the weights. abort: stop the run with an error naming the step; skip: leave the parameters and optimizer state as they were, count the step as skipped and go on (the data and the schedule move on), stopping when more than max_skipped steps in a row are skipped."""
    max_skipped: int = 5
    """nonfinite skip: the most consecutive skipped steps tolerated; one more stops the run."""
    spike_factor: float = 1.5
    """Print a warning when a step's loss exceeds spike_factor x the mean loss of the previous 20 steps; 0: off."""
    stop_at: int = 0
    """Stop after this step (saving a checkpoint when checkpoint.every > 0) without changing the schedule, which still runs to train.steps; 0: run to train.steps. For jobs split over several allocations."""


@dataclass
class DataConfig:
    """Training data."""

    paths: Any = "builtin"
    """Token source: builtin (a small embedded English corpus, no download); a Megatron-LM indexed dataset prefix (path without .bin/.idx, as written by meshtrain preprocess); a list of prefixes (equal weights); or a blend [[0.7, prefixA], [0.3, prefixB]]."""
    tokenizer: str = "bytes"
    """Tokenizer the data was written with: bytes (UTF-8 bytes + BOS 256 + EOS 257, vocabulary 258) or a path to a Hugging Face tokenizer.json. Used to check the vocabulary against model.vocab_size."""
    valid_fraction: float = 0.01
    """Share of each dataset's documents (its last ones) held out for validation; at least one document when > 0; 0: no validation split."""


@dataclass
class CheckpointConfig:
    """Checkpoints: torch.distributed.checkpoint directories <run_dir>/checkpoints/step_XXXXXXXX/ with parameters, optimizer state, step, data position and RNG states."""

    every: int = 0
    """Save a checkpoint every this many steps; 0: only at the end. A run always saves when it ends (train.steps or train.stop_at) or is stopped by SIGINT/SIGTERM, so the same command resumes it."""
    keep_last: int = 2
    """How many of the newest complete checkpoints to keep."""
    resume: str = "auto"
    """auto: continue from the newest complete checkpoint in <run_dir>/checkpoints if there is one; none: start at step 0; or the path of a checkpoint directory."""
    export: bool = False
    """At the end of fit, write the weights as a Hugging Face model directory (safetensors, config.json, generation_config.json, tokenizer files) into <run_dir>/export/, in fp32 for fp32 runs and bf16 otherwise."""


@dataclass
class RunConfig:
    """A training run."""

    run_dir: str = "runs/tiny"
    """Directory for config.yaml, plan.json, metrics.jsonl and checkpoints/."""
    seed: int = 0
    """Seed of the parameter initialisation and of the data sampler."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The model architecture."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """The parallel layout."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """The optimisation loop."""
    data: DataConfig = field(default_factory=DataConfig)
    """Training data."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoints."""

    # --- conversion --------------------------------------------------------------

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> "RunConfig":
        """Build from nested mappings (a parsed YAML file); unknown keys are ConfigErrors."""
        sections = {f.name: f.type for f in dataclasses.fields(RunConfig)}
        kwargs: dict[str, Any] = {}
        for key, value in d.items():
            if key not in sections:
                raise ConfigError(f"unknown config key {key!r}; known keys are {', '.join(sections)}")
            if key in _SECTIONS:
                kwargs[key] = _section_from_dict(_SECTIONS[key], key, value)
            else:
                kwargs[key] = value
        return RunConfig(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        import yaml

        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=False)

    # --- validation --------------------------------------------------------------

    def validate(self) -> "RunConfig":
        """Raise ConfigError for the first value that cannot work. Needs no process group:
        checks that depend on the world size (fsdp=-1) are repeated once it is known."""
        if not isinstance(self.run_dir, str) or not self.run_dir:
            raise ConfigError("run_dir must be a non-empty path")
        _check_int(self.seed, "seed", minimum=0)
        _validate_model(self.model)
        _validate_parallel(self.parallel)
        _validate_train(self.train)
        _validate_data(self.data)
        _validate_checkpoint(self.checkpoint)
        m, p, t = self.model, self.parallel, self.train
        if t.seq_len > m.max_seq_len:
            raise ConfigError(f"train.seq_len={t.seq_len} exceeds model.max_seq_len={m.max_seq_len}: "
                              f"use a shorter seq_len or raise max_seq_len")
        if self.data.tokenizer == "bytes" and m.vocab_size < BYTES_VOCAB:
            raise ConfigError(f"model.vocab_size={m.vocab_size} is smaller than the bytes tokenizer's "
                              f"vocabulary ({BYTES_VOCAB}: 256 bytes, BOS, EOS): set model.vocab_size to at least "
                              f"{BYTES_VOCAB}")
        if t.eval_every and not self.data.valid_fraction:
            raise ConfigError(f"train.eval_every={t.eval_every} needs a validation split, but "
                              "data.valid_fraction=0: set data.valid_fraction (e.g. 0.01), or train.eval_every 0")
        if p.tp > 1:
            split = {"model.n_heads": m.n_heads, "model.vocab_size": m.vocab_size}
            if m.arch == "llama":
                split["model.n_kv_heads"] = m.n_kv_heads or m.n_heads
            split["model.ffn_dim"] = m.ffn_dim or 4 * m.dim
            if m.moe is not None:
                split["model.moe.expert_ffn_dim"] = m.moe.expert_ffn_dim
            for key, n in split.items():
                if n % p.tp:
                    options = [d for d in range(1, max(split.values()) + 1)
                               if all(v % d == 0 for v in split.values())]
                    raise ConfigError(f"parallel.tp={p.tp} does not divide {key}={n} (tensor parallelism "
                                      f"splits it evenly over the tp ranks): choose parallel.tp among "
                                      f"{', '.join(map(str, options))}, or change {key}")
            if p.sp and t.seq_len % p.tp:
                raise ConfigError(f"parallel.sp=true shards the sequence over parallel.tp={p.tp} ranks, but "
                                  f"train.seq_len={t.seq_len} is not divisible by {p.tp}: choose a seq_len "
                                  f"that is a multiple of tp, or set parallel.sp false")
        if p.cp > 1:
            _validate_context_parallel(self)
        if p.ep > 1:
            _validate_experts(self)
        if self.checkpoint.export:  # what Hugging Face cannot express fails now, not after training
            from ..interop.hf import to_hf_config

            try:
                to_hf_config(m.arch, self.family_config())
            except ConfigError as e:
                raise ConfigError(f"checkpoint.export=true: {e}; or set checkpoint.export false") from None

        dp = p.dp * (1 if p.fsdp == -1 else p.fsdp)
        if t.global_batch % (t.micro_batch * dp):
            raise ConfigError(_batch_message(t, p.dp, p.fsdp, dp))
        if p.pp > 1:
            _validate_pipeline(self)
        elif p.pp_layout is not None:  # one stage: a layout must say so, not be ignored
            from ..pipeline.partition import partition

            partition(self.model_def(), 1, 1, p.pp_layout, seq_len=t.seq_len, micro_batch=t.micro_batch)
        # Any other layout problem the planner can see before the world size is known (a
        # -1 axis taken as the least that lets ep fold from fsdp x cp).
        self.plan(world=None, fill=p.ep // math.gcd(p.ep, p.cp))
        return self

    def plan(self, world: int | None, fill: int | None = None):
        """The Plan of this config for `world` ranks (None: the product of the fixed sizes,
        with a -1 axis taken as `fill`)."""
        from ..parallel.plan import make_plan
        from ..train.step import check_compile_with_checkpointing, check_compile_with_cp

        plan = make_plan(self.model_def().specs, self.rules(), self.mesh_spec(fill=fill), world=world,
                         cp_comm=self.parallel.cp_comm)
        if world is not None:  # the batch against the resolved data-parallel size, before any rank starts
            self._check_batch_at(plan.mesh)
        if self.train.compile:
            check_compile_with_cp(plan.mesh)
            check_compile_with_checkpointing(self.model.moe is not None, self.train.activation_checkpointing)
        return plan

    # --- what the run is built from ----------------------------------------------

    def family_config(self):
        """The model family's own config (LlamaConfig, GPT2Config)."""
        from ..models import FAMILIES

        m = self.model
        module = FAMILIES[m.arch]
        if m.arch == "llama":
            return module.LlamaConfig(dim=m.dim, n_layers=m.n_layers, n_heads=m.n_heads,
                                      n_kv_heads=m.n_kv_heads or m.n_heads, ffn_dim=m.ffn_dim,
                                      vocab_size=m.vocab_size, max_seq_len=m.max_seq_len,
                                      rope_theta=m.rope_theta, norm_eps=m.norm_eps,
                                      tie_embeddings=m.tie_embeddings, rope_scaling=m.rope_scaling,
                                      qk_norm=m.qk_norm, attn_head_dim=m.head_dim, moe=self.moe_config())
        return module.GPT2Config(dim=m.dim, n_layers=m.n_layers, n_heads=m.n_heads, ffn_dim=m.ffn_dim,
                                 vocab_size=m.vocab_size, max_seq_len=m.max_seq_len, norm_eps=m.norm_eps,
                                 tie_embeddings=m.tie_embeddings)

    def moe_config(self):
        from ..models.moe import MoeConfig

        moe = self.model.moe
        if moe is None:
            return None
        return MoeConfig(**(dataclasses.asdict(moe) if dataclasses.is_dataclass(moe) else moe))

    def model_def(self):
        from ..models import build

        return build(self.model.arch, self.family_config())

    def rules(self):
        from ..parallel.rules import Rules

        return Rules.default(sp=self.parallel.sp)

    def mesh_spec(self, fill: int | None = None):
        """The MeshSpec of parallel.*; `fill` replaces a -1 axis (None keeps -1)."""
        from ..parallel.mesh import MeshSpec

        p = self.parallel
        sizes = {a: getattr(p, a) for a in ("pp", "dp", "fsdp", "cp", "tp", "ep")}
        if fill is not None:
            sizes = {a: fill if n == -1 else n for a, n in sizes.items()}
        return MeshSpec(**sizes)

    def _check_batch_at(self, mesh) -> None:
        """accumulation_steps for a resolved mesh, naming the -1 axis that took the world's ranks."""
        p, t = self.parallel, self.train
        dp_size = mesh.dp * mesh.fsdp
        filled = [a for a in ("dp", "fsdp") if getattr(p, a) == -1]
        if filled and t.global_batch % (t.micro_batch * dp_size):
            per = t.micro_batch * dp_size
            raise ConfigError(
                f"train.global_batch={t.global_batch} is not divisible by train.micro_batch={t.micro_batch} x "
                f"data-parallel size {dp_size} (parallel.dp={mesh.dp} x parallel.fsdp={mesh.fsdp}, where "
                f"parallel.{filled[0]}=-1 takes the ranks left of world size {mesh.world}; "
                f"parallel.nproc_per_node={p.nproc_per_node}) = {per} sequences per micro-step: choose a "
                f"global_batch that is a multiple of {per}, a smaller micro_batch, or fewer ranks "
                "(parallel.nproc_per_node, the launcher's, or meshtrain plan --world)")
        self.accumulation_steps(dp_size)

    def accumulation_steps(self, dp_size: int) -> int:
        """Micro-steps per optimizer step for `dp_size` data-parallel ranks (dp * fsdp)."""
        t = self.train
        if t.global_batch % (t.micro_batch * dp_size):
            raise ConfigError(_batch_message(t, self.parallel.dp, dp_size // max(self.parallel.dp, 1), dp_size))
        m = t.global_batch // (t.micro_batch * dp_size)
        if self.parallel.pp > 1:
            _check_micro_batches(self.parallel, m, t, dp_size)
        return m


_SECTIONS = {"model": ModelConfig, "parallel": ParallelConfig, "train": TrainConfig, "data": DataConfig,
             "checkpoint": CheckpointConfig}


def _section_from_dict(cls, key: str, value: Any):
    if isinstance(value, cls):
        return value
    if not isinstance(value, Mapping):
        raise ConfigError(f"{key} must be a mapping of its fields, got {value!r}")
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = [k for k in value if k not in names]
    if unknown:
        raise ConfigError(f"unknown config key {key}.{unknown[0]}; {key} has {', '.join(names)}")
    value = dict(value)
    if cls is ModelConfig and value.get("moe") is not None:
        value["moe"] = _section_from_dict(MoeSection, "model.moe", value["moe"])
    return cls(**value)


def _batch_message(t: TrainConfig, dp: int, fsdp: int, dp_size: int) -> str:
    per_micro = t.micro_batch * dp_size
    return (f"train.global_batch={t.global_batch} is not divisible by train.micro_batch={t.micro_batch} x "
            f"data-parallel size {dp_size} (parallel.dp={dp} x parallel.fsdp={fsdp}) = {per_micro} sequences "
            f"per micro-step: choose a global_batch that is a multiple of {per_micro}, or a smaller micro_batch")


def _check_int(value, key: str, minimum: int | None = None, maximum: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{key}={value!r} must be an integer")
    if minimum is not None and value < minimum:
        raise ConfigError(f"{key}={value} must be at least {minimum}")
    maximum = MAX_SIZES.get(key) if maximum is None else maximum
    if maximum is not None and value > maximum:
        raise ConfigError(f"{key}={value} exceeds the largest supported value {maximum}, far beyond any real "
                          f"model: choose a smaller {key.rsplit('.', 1)[-1]}")


def _check_float(value, key: str, minimum: float | None = None, positive: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{key}={value!r} must be a finite number")
    if positive and value <= 0:
        raise ConfigError(f"{key}={value} must be positive")
    if minimum is not None and value < minimum:
        raise ConfigError(f"{key}={value} must be at least {minimum}")


def _check_bool(value, key: str) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"{key}={value!r} must be true or false")


def _choice(value, key: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{key}={value!r}: choose one of {', '.join(choices)}")


def _validate_model(m: ModelConfig) -> None:
    from ..models import FAMILIES

    supported = tuple(a for a in ("llama", "gpt2") if a in FAMILIES)
    if m.arch not in supported:
        raise ConfigError(f"model.arch={m.arch!r}: choose one of {', '.join(supported)}")
    for key in ("dim", "n_layers", "n_heads", "vocab_size", "max_seq_len"):
        _check_int(getattr(m, key), f"model.{key}", minimum=1)
    for key in ("n_kv_heads", "ffn_dim"):
        if getattr(m, key) is not None:
            _check_int(getattr(m, key), f"model.{key}", minimum=1)
    _check_float(m.norm_eps, "model.norm_eps", positive=True)
    _check_bool(m.tie_embeddings, "model.tie_embeddings")
    if m.init_from is not None and (not isinstance(m.init_from, str) or not m.init_from):
        raise ConfigError(f"model.init_from={m.init_from!r}: give the path of a Hugging Face model directory, "
                          "or null")
    if m.rope_scaling is not None:
        keys = {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}
        if m.arch != "llama":
            raise ConfigError(f"model.rope_scaling={m.rope_scaling!r} is llama-only, but model.arch={m.arch!r} "
                              "(learned positions): set model.rope_scaling null")
        if not isinstance(m.rope_scaling, dict) or set(m.rope_scaling) != keys:
            raise ConfigError(f"model.rope_scaling={m.rope_scaling!r}: give null, or (llama only) a mapping with "
                              f"exactly the keys {', '.join(sorted(keys))}")
        for key, value in m.rope_scaling.items():
            _check_float(value, f"model.rope_scaling.{key}", positive=True)
        s = m.rope_scaling
        if s["factor"] < 1:
            raise ConfigError(f"model.rope_scaling.factor={s['factor']} must be at least 1 (it stretches the "
                              "low frequencies for a longer context, e.g. 8)")
        if s["low_freq_factor"] >= s["high_freq_factor"]:
            raise ConfigError(f"model.rope_scaling.low_freq_factor={s['low_freq_factor']} must be below "
                              f"model.rope_scaling.high_freq_factor={s['high_freq_factor']} (the frequencies "
                              "between them are interpolated; Llama 3.1: 1 and 4)")
        _check_int(s["original_max_position_embeddings"], "model.rope_scaling.original_max_position_embeddings",
                   minimum=1)
    if m.arch == "llama":
        if m.ffn_dim is None:
            raise ConfigError("model.ffn_dim is null, but llama needs an explicit MLP size: set model.ffn_dim "
                              "(e.g. about 8/3 * dim rounded to a multiple of 16)")
        if m.rope_theta is None:
            raise ConfigError("model.rope_theta is null, but llama uses RoPE: set model.rope_theta "
                              "(10000.0 for Llama-2-style models, 500000.0 for Llama-3)")
        _check_float(m.rope_theta, "model.rope_theta", positive=True)
    else:  # gpt2: no GQA, learned positions
        if m.n_kv_heads is not None and m.n_kv_heads != m.n_heads:
            raise ConfigError(f"model.n_kv_heads={m.n_kv_heads}: model.arch=gpt2 has no grouped-query attention; set "
                              f"model.n_kv_heads to null (or to model.n_heads={m.n_heads}), e.g. "
                              "--model.n_kv_heads null")
        if m.rope_theta is not None:
            raise ConfigError(f"model.rope_theta={m.rope_theta}: model.arch=gpt2 uses learned absolute positions, not "
                              "RoPE; set model.rope_theta to null, e.g. --model.rope_theta null")
    _check_bool(m.qk_norm, "model.qk_norm")
    if m.head_dim is not None:
        _check_int(m.head_dim, "model.head_dim", minimum=2)
    if m.arch != "llama":
        for key, value in (("qk_norm", m.qk_norm or None), ("head_dim", m.head_dim), ("moe", m.moe)):
            if value is not None:
                raise ConfigError(f"model.{key}={value!r} is llama-only, but model.arch={m.arch!r}: set model.arch "
                                  f"llama, or model.{key} {'false' if key == 'qk_norm' else 'null'} (model.qk_norm, "
                                  "model.head_dim and model.moe are llama-only)")
    else:  # RoPE rotates pairs of dims: the head dim must be even (said here in terms of the keys)
        if m.head_dim is not None and m.head_dim % 2:
            raise ConfigError(f"model.head_dim={m.head_dim} is odd: RoPE rotates pairs of dims; choose an even "
                              "head_dim")
        if m.head_dim is None and m.dim % m.n_heads == 0 and (m.dim // m.n_heads) % 2:
            raise ConfigError(f"model.dim={m.dim} / model.n_heads={m.n_heads} = {m.dim // m.n_heads} is odd, but "
                              "RoPE needs an even head dim: choose dim and n_heads with an even ratio, or set "
                              "model.head_dim")
    if m.moe is not None:
        _validate_moe(m.moe, m.n_layers)
    # The family's own checks (head divisibility, even head dim, ...).
    RunConfig(model=m).family_config()


def _validate_moe(e: MoeSection, n_layers: int) -> None:
    from ..models.moe import BALANCES, ROUTERS

    if not isinstance(e, MoeSection):
        raise ConfigError(f"model.moe={e!r} must be a mapping of its fields, or null")
    for key, minimum in (("num_experts", 1), ("top_k", 1), ("expert_ffn_dim", 1), ("shared_experts", 0)):
        _check_int(getattr(e, key), f"model.moe.{key}", minimum=minimum)
    if e.top_k > e.num_experts:
        raise ConfigError(f"model.moe.top_k={e.top_k} exceeds model.moe.num_experts={e.num_experts}: a token "
                          "cannot go to more experts than there are")
    _choice(e.router, "model.moe.router", ROUTERS)
    _choice(e.balance, "model.moe.balance", BALANCES)
    for key in ("aux_coef", "z_loss_coef", "bias_update_rate"):
        _check_float(getattr(e, key), f"model.moe.{key}", minimum=0.0)
    _check_float(e.route_scale, "model.moe.route_scale", positive=True)
    _check_bool(e.norm_topk, "model.moe.norm_topk")
    if e.capacity_factor is not None:
        _check_float(e.capacity_factor, "model.moe.capacity_factor", positive=True)
    from ..models.moe import MoeConfig

    if not MoeConfig(layers=e.layers).moe_layers(n_layers):
        raise ConfigError(f"model.moe.layers={e.layers!r} selects no block of model.n_layers={n_layers}: choose "
                          "some, or set model.moe null")


def _validate_experts(cfg: "RunConfig") -> None:
    p, m = cfg.parallel, cfg.model
    if m.moe is None:
        raise ConfigError(f"parallel.ep={p.ep} shards experts, but model.moe is null (no experts): set "
                          "parallel.ep 1, or configure model.moe")
    if m.moe.num_experts % p.ep:
        raise ConfigError(f"parallel.ep={p.ep} does not divide model.moe.num_experts={m.moe.num_experts}: each "
                          "ep rank holds an equal share of the experts; choose an ep that divides num_experts")
    if cfg.train.compile:
        raise ConfigError(f"parallel.ep={p.ep} with train.compile true: the all-to-all's split sizes depend on "
                          "the routing, so expert-parallel steps run eager; set train.compile false")


def _validate_parallel(p: ParallelConfig) -> None:
    _check_int(p.nproc_per_node, "parallel.nproc_per_node", minimum=1)
    _check_bool(p.sp, "parallel.sp")
    _check_int(p.ep, "parallel.ep", minimum=1)
    _check_int(p.cp, "parallel.cp", minimum=1)
    from ..parallel.plan import CP_COMMS

    _choice(p.cp_comm, "parallel.cp_comm", CP_COMMS)
    _check_int(p.pp, "parallel.pp", minimum=1)
    _check_int(p.pp_virtual, "parallel.pp_virtual", minimum=1)
    _choice(p.pp_schedule, "parallel.pp_schedule", PP_SCHEDULES)
    if p.pp == 1 and p.pp_virtual > 1:
        raise ConfigError(f"parallel.pp_virtual={p.pp_virtual} sets pipeline stages per pp rank, but parallel.pp=1 "
                          "(no pipeline): set pp_virtual 1, or parallel.pp > 1")
    if p.pp_layout is not None:
        if not isinstance(p.pp_layout, list) or not p.pp_layout:
            raise ConfigError(f"parallel.pp_layout={p.pp_layout!r}: give a list of layers per stage, e.g. [3, 2], "
                              "or null to balance by cost")
        for i, k in enumerate(p.pp_layout):
            _check_int(k, f"parallel.pp_layout[{i}]", minimum=1)
    _check_float(p.collective_timeout_s, "parallel.collective_timeout_s", positive=True)
    if p.collective_timeout_s > MAX_TIMEOUT_S:
        raise ConfigError(f"parallel.collective_timeout_s={p.collective_timeout_s} exceeds {MAX_TIMEOUT_S:g} s "
                          "(about 3 years), more than a process group's timeout can hold: choose a smaller "
                          "timeout (the default is 900)")
    _check_float(p.watchdog_s, "parallel.watchdog_s", minimum=0.0)
    if p.watchdog_s and p.watchdog_s >= p.collective_timeout_s:
        raise ConfigError(f"parallel.watchdog_s={p.watchdog_s} must be below parallel.collective_timeout_s="
                          f"{p.collective_timeout_s}, or a timed-out collective ends the run before the watchdog "
                          "can name the stalled rank: lower watchdog_s, raise collective_timeout_s, or set "
                          "watchdog_s 0 (off)")
    fill = []
    for axis in ("dp", "fsdp", "tp"):
        n = getattr(p, axis)
        _check_int(n, f"parallel.{axis}")
        if n == 0 or n < -1:
            raise ConfigError(f"parallel.{axis}={n}: sizes must be positive, or -1 to take the remaining ranks")
        if n == -1:
            fill.append(axis)
    if len(fill) > 1:
        raise ConfigError(f"parallel: only one axis may be -1 (it takes the remaining ranks), got "
                          f"{', '.join(f'parallel.{a}=-1' for a in fill)}; give all but one a fixed size")


def _validate_context_parallel(cfg: "RunConfig") -> None:
    p, t = cfg.parallel, cfg.train
    if t.seq_len % (2 * p.cp):
        raise ConfigError(f"parallel.cp={p.cp} splits each sequence into 2 x cp = {2 * p.cp} equal chunks "
                          f"(zigzag), but train.seq_len={t.seq_len} is not a multiple of {2 * p.cp}: choose a "
                          f"seq_len that is (e.g. {t.seq_len // (2 * p.cp) * 2 * p.cp or 2 * p.cp})")
    if p.sp and p.tp > 1 and t.seq_len % (p.cp * p.tp):
        raise ConfigError(f"parallel.sp=true splits each cp rank's positions over parallel.tp={p.tp} ranks: "
                          f"train.seq_len={t.seq_len} must be a multiple of cp x tp = {p.cp * p.tp}; choose "
                          "such a seq_len or set parallel.sp false")


def _validate_pipeline(cfg: "RunConfig") -> None:
    """Pipeline rules that need the model and the batch: stages fit the layers, the
    schedule fits the micro-batch count (with fsdp=-1 the count is rechecked once the
    world size is known)."""
    p, t = cfg.parallel, cfg.train
    from ..pipeline.schedule import check_checkpointing

    check_checkpointing(p.pp_schedule, t.activation_checkpointing)
    if t.compile:
        raise ConfigError(f"parallel.pp={p.pp} with train.compile true: the pipeline executor runs eager; set "
                          "train.compile false")
    if p.pp_virtual > 1 and p.pp_schedule != "interleaved":
        raise ConfigError(f"parallel.pp_virtual={p.pp_virtual} needs parallel.pp_schedule interleaved "
                          f"({p.pp_schedule} runs one stage per rank); set pp_virtual 1 or pp_schedule interleaved")
    if p.pp_schedule == "interleaved" and p.pp_virtual < 2:
        raise ConfigError("parallel.pp_schedule=interleaved needs parallel.pp_virtual >= 2 stages per rank; "
                          "set pp_virtual 2 (or use pp_schedule 1f1b)")
    dp = p.dp * (1 if p.fsdp == -1 else p.fsdp)
    if t.global_batch % (t.micro_batch * dp) == 0:
        _check_micro_batches(p, t.global_batch // (t.micro_batch * dp), t, dp)
    from ..pipeline.partition import partition

    partition(cfg.model_def(), p.pp, p.pp_virtual, p.pp_layout, seq_len=t.seq_len, micro_batch=t.micro_batch)


def _check_micro_batches(p: ParallelConfig, m: int, t: TrainConfig, dp_size: int) -> None:
    """The micro-batch count m = global_batch / (micro_batch x dp x fsdp) against the schedule."""
    if p.pp_schedule == "interleaved" and m % p.pp:
        good = t.micro_batch * dp_size * p.pp * -(-m // p.pp)
        raise ConfigError(f"parallel.pp_schedule=interleaved needs the micro-batch count (train.global_batch="
                          f"{t.global_batch} / (train.micro_batch={t.micro_batch} x data-parallel size {dp_size}) = "
                          f"{m}) to be a multiple of parallel.pp={p.pp}: change global_batch (e.g. {good}) or "
                          "micro_batch so that it is")


def _validate_train(t: TrainConfig) -> None:
    from ..train.schedule import LR_SCHEDULES

    for key in ("steps", "global_batch", "micro_batch", "seq_len", "log_every", "eval_batches"):
        _check_int(getattr(t, key), f"train.{key}", minimum=1)
    for key in ("steps", "warmup_steps", "stop_at", "eval_every"):  # a typo, not a run
        _check_int(getattr(t, key), f"train.{key}", minimum=0, maximum=MAX_STEPS)
    if t.global_batch % t.micro_batch:
        raise ConfigError(f"train.global_batch={t.global_batch} is not divisible by train.micro_batch="
                          f"{t.micro_batch}: choose a global_batch that is a multiple of micro_batch")
    _check_float(t.lr, "train.lr", positive=True)
    _check_float(t.min_lr, "train.min_lr", minimum=0.0)
    if t.min_lr > t.lr:
        raise ConfigError(f"train.min_lr={t.min_lr} exceeds train.lr={t.lr}: min_lr is where the decay ends")
    _choice(t.lr_schedule, "train.lr_schedule", LR_SCHEDULES)
    _check_float(t.weight_decay, "train.weight_decay", minimum=0.0)
    if t.grad_clip is not None:
        _check_float(t.grad_clip, "train.grad_clip", minimum=0.0)
    _choice(t.precision, "train.precision", PRECISIONS)
    _check_bool(t.compile, "train.compile")
    _choice(t.fp8_recipe, "train.fp8_recipe", FP8_RECIPES)
    _choice(t.activation_checkpointing, "train.activation_checkpointing", CHECKPOINTING)
    _choice(t.nonfinite, "train.nonfinite", NONFINITE)
    _check_int(t.max_skipped, "train.max_skipped", minimum=0)
    _check_float(t.spike_factor, "train.spike_factor", minimum=0.0)
    if 0 < t.spike_factor <= 1:
        raise ConfigError(f"train.spike_factor={t.spike_factor}: a spike is a loss above factor x the recent mean, "
                          "so the factor must exceed 1 (e.g. 1.5), or be 0 to turn the warning off")


def _validate_data(d: DataConfig) -> None:
    # The shape of data.paths only; files and tokens are checked when the data is opened.
    from ..data import DataError, parse_paths

    try:
        parse_paths(d.paths)
    except DataError as e:
        raise ConfigError(str(e)) from None
    if not isinstance(d.tokenizer, str) or not d.tokenizer:
        raise ConfigError(f"data.tokenizer={d.tokenizer!r}: give bytes or the path of a tokenizer.json")
    _check_float(d.valid_fraction, "data.valid_fraction", minimum=0.0)
    if d.valid_fraction >= 1:
        raise ConfigError(f"data.valid_fraction={d.valid_fraction} leaves no training data: choose a value "
                          "below 1 (e.g. 0.01)")


def _validate_checkpoint(c: CheckpointConfig) -> None:
    _check_int(c.every, "checkpoint.every", minimum=0)
    _check_int(c.keep_last, "checkpoint.keep_last", minimum=1)
    _check_bool(c.export, "checkpoint.export")
    if not isinstance(c.resume, str) or not c.resume:
        raise ConfigError(f"checkpoint.resume={c.resume!r}: give auto, none, or a checkpoint directory")
