"""The parallel.* section of a run config: the mesh sizes, the pipeline's shape, the
traffic switches (handed to layout/traffic.py's Traffic) and the timeouts, checked here."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError, check_bool, check_choice, check_float, check_int
from .mesh import CP_COMMS, PP_SCHEDULES
from .traffic import Traffic

MAX_TIMEOUT_S = 1.0e8  # about 3 years: a process group's timeout must fit a timedelta and int64 milliseconds


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
    bucket: str | float = Traffic.bucket
    """Unit of parameter communication: block (the weights of one transformer block, and the groups before and after the blocks, gathered by one all-gather from one flat buffer and their gradients reduced by one collective per mesh group), param (one collective per parameter: the reference behaviour), or a bucket size in MB (consecutive parameters up to that size). A block's expert weights (ep > 1) are a bucket of their own, on the expert mesh; strided shards keep one collective per parameter."""
    prefetch: int = Traffic.prefetch
    """Buckets whose all-gather is issued ahead of use: 1 starts block i+1's gather before block i computes (and, in eager backward, block i-1's before block i); 0 gathers each where it is used. Each one in flight holds one more block's gathered weights. Also the most gradient reductions left in flight (eager), each holding one block's packed gradients."""
    reshard_after_forward: bool = Traffic.reshard_after_forward
    """ZeRO-3: drop gathered weights after each block's forward and gather them again in backward (eager: a bucket at a time; compiled: each weight's gather recomputed where backward needs it, docs/parallelism.md). false keeps them from forward to backward: one all-gather per bucket (compiled: per weight) per micro-step fewer, at the memory of the whole gathered model."""
    fsdp_accumulate: str = Traffic.fsdp_accumulate
    """How fsdp gradients add up over a step's micro-steps. sharded: each micro-step's are reduce-scattered (FSDP2's default; only shards are held). unsharded: each block's full fp32 gradients accumulate locally and are reduce-scattered once, on the last micro-step: one reduce-scatter per bucket per step instead of per micro-step, for the memory of the whole model's unsharded gradients between micro-steps. Needs buckets (not parallel.bucket param) and no pipeline (parallel.pp 1); eager and compiled."""
    pp_keep_gathered: bool = Traffic.keep_gathered
    """Under a pipeline with fsdp: gather each pp rank's stage weights once per step (in the compute dtype, before the first micro-batch) and keep them over the step's micro-batches; their gradients add up unsharded (fp32) and are reduce-scattered once, after the last backward (TorchTitan's unsharded pipeline stages; zero 1 under a pipeline). Saves per micro-batch one all-gather (two with reshard_after_forward) and one reduce-scatter per bucket, for the memory of the stage's whole weights and fp32 gradient sums; `meshtrain plan` shows both sides. Needs parallel.pp > 1 and buckets (not parallel.bucket param)."""
    zero: int = 3
    """ZeRO stage of the fsdp (x cp) sharding. 3: parameters, gradients and optimizer state sharded, weights gathered per micro-batch (FSDP; the other traffic keys shape it). 1: Megatron's distributed optimizer (--use-distributed-optimizer): each bucket's weights gathered once per step in the compute dtype (eager: at its first use, the next ones issued ahead; --overlap-param-gather) and kept over the micro-batches, no gathers in forward or backward, the fp32 shards and optimizer state sharded, the gradients summed whole in fp32 over the micro-batches and reduce-scattered once per step (eager: each bucket in the last backward once complete; --overlap-grad-reduce). 2: the same, the gradients reduce-scattered every micro-batch (sharded between them). Checkpoints are layout-free: a run resumes at another stage. Under a pipeline, 1 is parallel.pp_keep_gathered. Needs buckets (not parallel.bucket param)."""
    collective_timeout_s: float = 900.0
    """Seconds a collective may wait for its peers before it fails (the process group's timeout; at most 1e8)."""
    watchdog_s: float = 600.0
    """Seconds a rank may go without progress (a step, an evaluation, a checkpoint) before the watchdog names the stalled rank, its step and operation, and ends the job; 0: off. Must be below collective_timeout_s so its report comes first; raise it above your slowest step (the first one compiles)."""

    def traffic(self) -> Traffic:
        """The traffic switches as the runtime and the estimators take them."""
        kept = self.pp_keep_gathered or (self.zero in (1, 2))
        return Traffic(bucket=self.bucket, prefetch=self.prefetch, reshard_after_forward=self.reshard_after_forward,
                       fsdp_accumulate=self.fsdp_accumulate, keep_gathered=kept, zero=self.zero)

    def check(self) -> "ParallelConfig":
        """Raise ConfigError naming the parallel.* key and the fix for a value that cannot work."""
        check_int(self.nproc_per_node, "parallel.nproc_per_node", 1)
        check_bool(self.sp, "parallel.sp")
        check_int(self.ep, "parallel.ep", 1)
        check_int(self.cp, "parallel.cp", 1)
        check_choice(self.cp_comm, "parallel.cp_comm", CP_COMMS)
        check_int(self.pp, "parallel.pp", 1)
        check_int(self.pp_virtual, "parallel.pp_virtual", 1)
        check_choice(self.pp_schedule, "parallel.pp_schedule", PP_SCHEDULES)
        if self.pp == 1 and self.pp_virtual > 1:
            raise ConfigError(f"parallel.pp_virtual={self.pp_virtual} sets pipeline stages per pp rank, but parallel.pp=1 "
                              "(no pipeline): set pp_virtual 1, or parallel.pp > 1")
        if self.pp_layout is not None:
            if not isinstance(self.pp_layout, list) or not self.pp_layout:
                raise ConfigError(f"parallel.pp_layout={self.pp_layout!r}: give a list of layers per stage, e.g. [3, 2], "
                                  "or null to balance by cost")
            for i, k in enumerate(self.pp_layout):
                check_int(k, f"parallel.pp_layout[{i}]", 1)
        self.traffic().check()
        check_float(self.collective_timeout_s, "parallel.collective_timeout_s", positive=True)
        if self.collective_timeout_s > MAX_TIMEOUT_S:
            raise ConfigError(f"parallel.collective_timeout_s={self.collective_timeout_s} exceeds {MAX_TIMEOUT_S:g} s "
                              "(about 3 years), more than a process group's timeout can hold: choose a smaller "
                              "timeout (the default is 900)")
        check_float(self.watchdog_s, "parallel.watchdog_s", minimum=0.0)
        if self.watchdog_s and self.watchdog_s >= self.collective_timeout_s:
            raise ConfigError(f"parallel.watchdog_s={self.watchdog_s} must be below parallel.collective_timeout_s="
                              f"{self.collective_timeout_s}, or a timed-out collective ends the run before the watchdog "
                              "can name the stalled rank: lower watchdog_s, raise collective_timeout_s, or set "
                              "watchdog_s 0 (off)")
        fill = []
        for axis in ("dp", "fsdp", "tp"):
            n = getattr(self, axis)
            check_int(n, f"parallel.{axis}")
            if n == 0 or n < -1:
                raise ConfigError(f"parallel.{axis}={n}: sizes must be positive, or -1 to take the remaining ranks")
            if n == -1:
                fill.append(axis)
        if len(fill) > 1:
            raise ConfigError(f"parallel: only one axis may be -1 (it takes the remaining ranks), got "
                              f"{', '.join(f'parallel.{a}=-1' for a in fill)}; give all but one a fixed size")
        return self

