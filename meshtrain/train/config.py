"""The train.* section of a run config: the optimisation loop's keys, checked here."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields

from ..errors import ConfigError, check_bool, check_choice, check_float, check_int
from .loss_scale import LossScaleConfig
from .lr_schedule import LR_SCHEDULES

NONFINITE = ("abort", "skip")  # train.nonfinite: run/guards.py acts on it


MAX_STEPS = 10**12  # a million times the longest pre-training runs

OPTIMIZERS = ("adamw", "muon")  # train.optimizer: train/optim.py, train/muon.py
ADJUST_LR = ("original", "match_rms_adamw")  # train.muon.adjust_lr: torch.optim.Muon's adjust_lr_fn
MAX_NS_STEPS = 99  # torch.optim.Muon refuses 100 or more


@dataclass
class MuonConfig:
    """Muon (train.optimizer muon) for the blocks' weight matrices; the rest stays on AdamW."""

    lr: float | None = None
    """Muon's peak learning rate, following train.lr_schedule (at step t: the schedule's lr x muon.lr / train.lr). null: train.lr."""
    momentum: float = 0.95
    """Momentum of the gradient buffer (torch.optim.Muon's momentum)."""
    nesterov: bool = True
    """Nesterov momentum: orthogonalise grad + momentum x buffer instead of the buffer."""
    ns_steps: int = 5
    """Newton-Schulz iterations per matrix (bf16, Keller Jordan's quintic coefficients)."""
    adjust_lr: str = "original"
    """Learning rate scale per matrix of shape (A, B): original, sqrt(max(1, A/B)); match_rms_adamw, 0.2 x sqrt(max(A, B)) (Moonshot's, which reuses AdamW's lr and weight decay)."""
    weight_decay: float | None = None
    """Decoupled weight decay of the Muon matrices (with the unadjusted lr). null: train.weight_decay."""

    def check(self) -> "MuonConfig":
        if self.lr is not None:
            check_float(self.lr, "train.muon.lr", positive=True)
        check_float(self.momentum, "train.muon.momentum", minimum=0.0)
        if self.momentum >= 1:
            raise ConfigError(f"train.muon.momentum={self.momentum} must be below 1 (the buffer would never forget): "
                              "use e.g. 0.95")
        check_bool(self.nesterov, "train.muon.nesterov")
        check_int(self.ns_steps, "train.muon.ns_steps", 1, MAX_NS_STEPS)
        check_choice(self.adjust_lr, "train.muon.adjust_lr", ADJUST_LR)
        if self.weight_decay is not None:
            check_float(self.weight_decay, "train.muon.weight_decay", minimum=0.0)
        return self


def muon_section(value) -> MuonConfig:
    """train.muon given as a MuonConfig or a mapping of its fields (unknown keys refused)."""
    if isinstance(value, MuonConfig):
        return value
    if not isinstance(value, Mapping):
        raise ConfigError(f"train.muon={value!r} must be a mapping of its fields (lr, momentum, ...)")
    names = [f.name for f in fields(MuonConfig)]
    unknown = [k for k in value if k not in names]
    if unknown:
        raise ConfigError(f"unknown config key train.muon.{unknown[0]}; train.muon has {', '.join(names)}")
    return MuonConfig(**value)


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
    """Compute precision: fp32; bf16; fp16 (with dynamic loss scaling, train.loss_scale); or fp8 (bf16, with the GEMMs of every linear except the embedding, head and MoE router in fp8, dynamically scaled). Parameters, gradients and optimizer state stay fp32."""
    loss_scale: LossScaleConfig = field(default_factory=LossScaleConfig)
    """fp16's dynamic loss scale: {init_scale, growth_factor, backoff_factor, growth_interval, min_scale} (torch.amp.GradScaler's rule and defaults); read only with train.precision fp16. A step whose gradients overflow is skipped on every rank and the scale backs off; metrics.jsonl logs loss_scale; checkpoints keep it."""
    fp8_recipe: str = "tensorwise"
    """Scaling of the fp8 GEMMs (train.precision fp8): tensorwise (one scale per tensor) or rowwise (one per row along the contracted dim)."""
    compile: bool = False
    """Compile the loss and the optimizer update with torch.compile (inductor, fullgraph)."""
    activation_checkpointing: str = "none"
    """Recompute activations in backward to save memory: none; selective (keep matmul and attention outputs, recompute norms, activations and the rest); full (keep only each block's input, recompute the block); offload (recompute nothing: what each transformer block saves for backward moves to host memory in forward and back in backward; the same numbers as none; not with train.compile)."""
    optimizer_offload: bool = False
    """Keep AdamW's moments (exp_avg, exp_avg_sq: 8 bytes per parameter) in host memory, pinned on CUDA, and run the update there: each step copies the gradients' shards to the host and the updated parameter shards back. The fp32 parameter shards stay on the device (every forward gathers from them). Same numbers as without; checkpoints save and load the moments wherever they live."""
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
    optimizer: str = "adamw"
    """adamw: AdamW for every parameter; muon: Muon (train.muon) for the blocks' weight matrices (attention, MLP, each expert's, MLA's projections; the MTP modules' too), AdamW for embeddings, the output head, norms, biases and routers."""
    muon: MuonConfig = field(default_factory=MuonConfig)
    """Muon's settings (train.optimizer muon); torch.optim.Muon's names and defaults."""

    def __post_init__(self):
        if isinstance(self.muon, Mapping):  # the Python API, a parsed YAML file
            self.muon = muon_section(self.muon)
        # train.loss_scale as a mapping of its fields (YAML, the Python API).
        if isinstance(self.loss_scale, Mapping):
            known = LossScaleConfig.__dataclass_fields__
            unknown = [k for k in self.loss_scale if k not in known]
            if unknown:
                raise ConfigError(f"unknown config key train.loss_scale.{unknown[0]}; train.loss_scale has "
                                  f"{', '.join(known)}")
            self.loss_scale = LossScaleConfig(**self.loss_scale)

    def check(self) -> "TrainConfig":
        """Raise ConfigError naming the train.* key and the fix for a value that cannot work."""
        # The choices live beside the precision policy, which imports torch.
        from ..models.fp8 import RECIPES
        from ..models.policy import ACTIVATION_MODES, PRECISIONS

        for key in ("steps", "global_batch", "micro_batch", "seq_len", "log_every", "eval_batches"):
            check_int(getattr(self, key), f"train.{key}", minimum=1)
        for key in ("steps", "warmup_steps", "stop_at", "eval_every"):  # a typo, not a run
            check_int(getattr(self, key), f"train.{key}", minimum=0, maximum=MAX_STEPS)
        if self.global_batch % self.micro_batch:
            raise ConfigError(f"train.global_batch={self.global_batch} is not divisible by train.micro_batch="
                              f"{self.micro_batch}: choose a global_batch that is a multiple of micro_batch")
        check_float(self.lr, "train.lr", positive=True)
        check_float(self.min_lr, "train.min_lr", minimum=0.0)
        if self.min_lr > self.lr:
            raise ConfigError(f"train.min_lr={self.min_lr} exceeds train.lr={self.lr}: min_lr is where the decay ends")
        check_choice(self.lr_schedule, "train.lr_schedule", LR_SCHEDULES)
        check_float(self.weight_decay, "train.weight_decay", minimum=0.0)
        if self.grad_clip is not None:
            check_float(self.grad_clip, "train.grad_clip", minimum=0.0)
        check_choice(self.precision, "train.precision", PRECISIONS)
        if not isinstance(self.loss_scale, LossScaleConfig):
            raise ConfigError(f"train.loss_scale={self.loss_scale!r} must be a mapping of its fields "
                              "(init_scale, growth_factor, backoff_factor, growth_interval, min_scale)")
        check_bool(self.compile, "train.compile")
        check_choice(self.fp8_recipe, "train.fp8_recipe", RECIPES)
        check_choice(self.activation_checkpointing, "train.activation_checkpointing", ACTIVATION_MODES)
        if self.compile and self.activation_checkpointing == "offload":
            raise ConfigError("train.activation_checkpointing=offload with train.compile true cannot run (torch "
                              "2.13's dynamo refuses the saved-tensor hooks that move activations to host): set "
                              "train.compile false, or activation_checkpointing selective or full")
        check_bool(self.optimizer_offload, "train.optimizer_offload")
        if self.optimizer_offload and self.optimizer == "muon":
            raise ConfigError("train.optimizer_offload=true moves AdamW's moments to host memory, which train.optimizer="
                              "muon does not do yet (its momentum exchange runs on the device): set "
                              "train.optimizer_offload false, or train.optimizer adamw")
        check_choice(self.nonfinite, "train.nonfinite", NONFINITE)
        check_int(self.max_skipped, "train.max_skipped", 0)
        check_choice(self.optimizer, "train.optimizer", OPTIMIZERS)
        muon_section(self.muon).check()
        check_float(self.spike_factor, "train.spike_factor", minimum=0.0)
        if 0 < self.spike_factor <= 1:
            raise ConfigError(f"train.spike_factor={self.spike_factor}: a spike is a loss above factor x the recent mean, "
                              "so the factor must exceed 1 (e.g. 1.5), or be 0 to turn the warning off")
        return self

