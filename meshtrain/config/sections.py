"""The sections of a run configuration (model, parallel, train, data, checkpoint) and the
bounds of their values. Every field has an attribute docstring: jsonargparse shows it in
--help. model.moe is the MoE layer's own MoeConfig (models/moe.py), which checks its fields
itself."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..layout.traffic import Traffic

# For the annotation only: importing meshtrain.models here would import torch with
# meshtrain.config. jsonargparse resolves the name from this block when the CLI builds its
# parser; ModelConfig and RunConfig.from_dict import the class when a config has a model.moe.
if TYPE_CHECKING:
    from ..models.moe import MoeConfig

NONFINITE = ("abort", "skip")  # train.nonfinite: run/guards.py acts on it, a layer above config/


BYTES_VOCAB = 258  # the bytes tokenizer: 256 byte values, BOS and EOS


# Upper bounds of the model sizes: far above any real model (Llama 3 405B: dim 16384, 126
# layers, ffn_dim 53248, 128 heads, vocabulary 128256), low enough that a typo fails here,
# not as an allocation, an overflow or an endless planning loop after the ranks have
# started. The vocabulary bound is the int32 token id. model.moe's are MoeConfig's own.
MAX_SIZES = {"model.dim": 2**20, "model.n_layers": 1024, "model.n_heads": 2**16, "model.n_kv_heads": 2**16,
             "model.ffn_dim": 2**22, "model.head_dim": 2**16, "model.vocab_size": 2**31 - 1,
             "model.max_seq_len": 2**24}


MAX_STEPS = 10**12  # a million times the longest pre-training runs


MAX_TIMEOUT_S = 1.0e8  # about 3 years: a process group's timeout must fit a timedelta and int64 milliseconds


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
    moe: MoeConfig | None = None
    """Mixture-of-experts blocks (llama only); null: every block is dense."""

    def __post_init__(self):
        # model.moe as a mapping of its fields (the Python API, a config.json read by interop).
        if isinstance(self.moe, Mapping):
            from ..models.moe import MoeConfig

            self.moe = MoeConfig(**self.moe)

    def family_config(self):
        """The model family's own config (LlamaConfig, GPT2Config, ...)."""
        from ..models import get_family

        return get_family(self.arch).from_fields(self)


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
    """Context parallelism: every activation's sequence dim split over cp ranks in load-balanced zigzag order (rank r holds chunks r and 2cp-1-r of 2cp); train.seq_len must be a multiple of 2 x cp. Parameters are fsdp-sharded over fsdp x cp. train.compile works with cp beside fsdp, dp and tp(+sp)."""
    cp_comm: str = "allgather"
    """How attention exchanges the sequence over cp: allgather (K/V all-gathered; any head count) | ring (K/V blocks passed around the cp ranks point to point, overlapped with compute) | a2a (Ulysses all-to-all to a head split; n_heads and n_kv_heads per tp rank must divide by cp)."""
    ep: int = 1
    """Expert parallelism (needs model.moe): each expert's weights live on one of ep ranks, drawn from the fsdp x cp ranks (folded, so ep is not a factor of the world size and must divide fsdp x cp); tokens reach their experts by all-to-all. Expert weights are fsdp-sharded over the fsdp x cp / ep ranks left and split over tp on their hidden dim."""
    pp: int = 1
    """Pipeline parallelism: the layers split into pp x pp_virtual stages over pp groups of ranks (outermost mesh axis). The micro-batches of a step (global_batch / (micro_batch x dp x fsdp)) flow through the stages; with train.compile each stage is compiled once."""
    pp_schedule: str = "1f1b"
    """Pipeline schedule: gpipe | 1f1b | interleaved (needs pp_virtual >= 2 and a micro-batch count divisible by pp) | zb (zero-bubble ZB-H1: backward split into input and weight gradients)."""
    pp_virtual: int = 1
    """Stages per pp rank (interleaved schedule: rank r holds stages r, r + pp, ...); 1 without a pipeline (pp 1)."""
    pp_layout: list[int] | None = None
    """Layers per stage, e.g. [3, 2] for 5 layers on 2 stages; null: balanced by a cost model (FLOPs of layers, embedding and head/loss)."""
    bucket: str | float = "block"
    """Unit of parameter communication: block (the weights of one transformer block, and the groups before and after the blocks, gathered by one all-gather from one flat buffer and their gradients reduced by one collective per mesh group), param (one collective per parameter: the reference behaviour), or a bucket size in MB (consecutive parameters up to that size). A block's expert weights (ep > 1) are a bucket of their own, on the expert mesh; strided shards keep one collective per parameter."""
    prefetch: int = 1
    """Buckets whose all-gather is issued ahead of use: 1 starts block i+1's gather before block i computes (and, in eager backward, block i-1's before block i); 0 gathers each where it is used. Each one in flight holds one more block's gathered weights. Also the most gradient reductions left in flight (eager), each holding one block's packed gradients."""
    reshard_after_forward: bool = True
    """ZeRO-3: drop gathered weights after each block's forward and gather them again in backward (eager: a bucket at a time; compiled: each weight's gather recomputed where backward needs it, docs/parallelism.md). false keeps them from forward to backward: one all-gather per bucket (compiled: per weight) per micro-step fewer, at the memory of the whole gathered model."""
    fsdp_accumulate: str = "sharded"
    """How fsdp gradients add up over a step's micro-steps. sharded: each micro-step's are reduce-scattered (FSDP2's default; only shards are held). unsharded: each block's full fp32 gradients accumulate locally and are reduce-scattered once, on the last micro-step: one reduce-scatter per bucket per step instead of per micro-step, for the memory of the whole model's unsharded gradients between micro-steps. Needs buckets (not parallel.bucket param) and no pipeline (parallel.pp 1); eager and compiled."""
    pp_keep_gathered: bool = False
    """Under a pipeline with fsdp: gather each pp rank's stage weights once per step (fp32, before the first micro-batch) and keep them over the step's micro-batches; their gradients add up unsharded (fp32) and are reduce-scattered once, after the last backward (TorchTitan's unsharded pipeline stages). Saves per micro-batch one all-gather (two with reshard_after_forward) and one reduce-scatter per bucket, for the memory of the stage's whole fp32 weights and gradients; `meshtrain plan` shows both sides. Needs parallel.pp > 1 and buckets (not parallel.bucket param)."""
    collective_timeout_s: float = 900.0
    """Seconds a collective may wait for its peers before it fails (the process group's timeout; at most 1e8)."""
    watchdog_s: float = 600.0
    """Seconds a rank may go without progress (a step, an evaluation, a checkpoint) before the watchdog names the stalled rank, its step and operation, and ends the job; 0: off. Must be below collective_timeout_s so its report comes first; raise it above your slowest step (the first one compiles)."""

    def traffic(self) -> Traffic:
        """The traffic switches as the runtime and the estimators take them."""
        return Traffic(bucket=self.bucket, prefetch=self.prefetch, reshard_after_forward=self.reshard_after_forward,
                       fsdp_accumulate=self.fsdp_accumulate, keep_gathered=self.pp_keep_gathered)


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
    document_mask: bool = False
    """Attention stays inside each document packed into a sample (Megatron's --reset-attention-mask): a document ends with the tokenizer's end-of-document token (EOS; preprocess --append_eod writes it)."""
    reset_positions: bool = False
    """Positions restart at 0 at each document's start (Megatron's --reset-position-ids): RoPE angles and GPT-2's learned positions. With document_mask on, RoPE sees only distances within a document, so this changes only GPT-2."""
    eod_mask_loss: bool = False
    """No loss on the token after an end-of-document token (Megatron's --eod-mask-loss): the next document's first token is not predicted from the last one's end. The loss is the mean over the global batch's remaining targets."""
    mean_doc_len: int = 0
    """For meshtrain plan with document_mask on: the mean document length in tokens, which sets the step's attention FLOPs and the eager attention's mask memory; 0: documents as long as train.seq_len. Training finds the documents in the data and ignores this."""


@dataclass
class CheckpointConfig:
    """Checkpoints: torch.distributed.checkpoint directories <run_dir>/checkpoints/step_XXXXXXXX/ with parameters, optimizer state, step, data position and RNG states."""

    every: int = 0
    """Save a checkpoint every this many steps; 0: only at the end. A run always saves when it ends (train.steps or train.stop_at) or is stopped by SIGINT/SIGTERM, so the same command resumes it."""
    keep_last: int = 2
    """How many of the newest complete checkpoints to keep."""
    resume: str = "auto"
    """auto: continue from the newest complete checkpoint in <run_dir>/checkpoints if there is one; none: start at step 0 in a run_dir that holds no run (refused where one has checkpoints or metrics); restart: first move the run in run_dir into <run_dir>/previous/<UTC time>/, then start at step 0; or the path of a checkpoint directory to continue from."""
    async_save: bool = False
    """Write checkpoints in the background: the step waits only while the state is copied to host memory (reused buffers, pinned on GPUs), then a thread writes and commits the checkpoint while training goes on; it becomes the latest only once every rank has written and the atomic rename is done. At most one save in flight: the next save, the end of the run, a stop signal, an error and the export wait for it (and report its failure as a synchronous save would). Off by default on CPU, where the writer shares the cores training uses and the copy costs as much memory as the state; the GPU presets turn it on."""
    export: bool = False
    """At the end of fit, write the weights as a Hugging Face model directory (safetensors, config.json, generation_config.json, tokenizer files) into <run_dir>/export/, in fp32 for fp32 runs and bf16 otherwise."""

