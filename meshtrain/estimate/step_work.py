"""What one micro-batch's forward and backward cost one rank in seconds, from the family's
recorded forward (models/recording.py) evaluated on the plan and read against a
`Hardware`: the work half of the step-time model (step_time.py adds communication, the
optimizer, the pipeline and the host).

Per recorded stretch (one block, the embedding, the head):
- matmuls: each ctx.linear as the GEMM a rank runs, (m, n, k) from its output's and its
  weight's local shapes; backward the input gradient (m, k, n) and, for a trainable
  weight, the weight gradient (n, k, m); fp8 where the precision policy runs the linear in
  fp8. An MoE block's experts: each local expert's three GEMMs on the rows routed to it
  (the uniform expectation, times the busiest expert's load: MOE_LOAD), and the router
  in fp32;
- attention: each ctx.attention call's causal FLOPs (the calibration's convention: the
  causal half of q k^T and p v, forward and backward = 3 x forward) over the keys a query
  spans (the row, or the mean packed document), at the attention curve (under cp, the
  block kernels' curve where the hardware has one);
- element-wise: every other op of the recording (norms, activations, residual adds,
  RoPE, casts) as the bytes it reads and writes on the rank, at the memory bandwidth;
  backward moves twice the forward's bytes in two kernels per op (assumed: each reads
  its saved input and the incoming gradient and writes one). A compiled step fuses
  them: COMPILED_BYTES of the bytes in COMPILED_KERNELS of the kernels (assumed; checked
  only through whole CPU steps, where element-wise work is small: bench/step_time_cpu.py
  --only "one process compiled" "fsdp2 compiled", docs/performance.md);
- host: each kernel's launch (`Hardware.launch_s`; in an eager step on a sharded mesh
  `sharded_launch_s`), in full where the host runs the kernels (a CPU), else where a
  kernel is shorter than it: the device waits for the next (`host_fwd`, `host_bwd`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch

from ..models.family import TOKENS
from ..models.policy import Policy
from ..models.recorded import record_block, record_ends
from ..models.recording import QUERY, Attend, Experts
from .hardware import Hardware
from .walker import Walker, routed_rows

COMPILED_BYTES = 0.5  # of the eager element-wise bytes, after inductor's fusion (assumed)
COMPILED_KERNELS = 0.25  # of the eager kernels (assumed)
# The busiest expert's rows over the mean, which every rank of an expert-parallel group
# waits for: balanced routing still fluctuates per batch; unbalanced collapses (assumed).
MOE_LOAD = {"aux": 1.1, "aux_free": 1.1, "none": 1.5}
BACKWARD_BYTES = 2.0  # a backward op's bytes over its forward's (assumed)


@dataclass
class Work:
    """Seconds of one micro-batch on one rank, and its counts. `host_*`: what kernels
    shorter than the host's launch add (the device waits for the next launch)."""

    matmul_fwd: float = 0.0
    matmul_bwd: float = 0.0
    wgrad: float = 0.0  # of matmul_bwd, the weight gradients (a split backward's W)
    attention: float = 0.0  # forward and backward
    elementwise_fwd: float = 0.0
    elementwise_bwd: float = 0.0
    host_fwd: float = 0.0
    host_bwd: float = 0.0
    host_elementwise_fwd: float = 0.0  # of host_fwd, the element-wise kernels' (selective checkpointing reruns them)
    kernels: int = 0  # forward kernel launches (matmuls, attention, element-wise)
    flops: float = 0.0  # executed FLOPs, forward and backward

    def __add__(self, other: "Work") -> "Work":
        return Work(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(Work)))

    def times(self, k: float) -> "Work":
        return Work(*(getattr(self, f.name) * k for f in fields(Work)))

    @property
    def forward(self) -> float:
        return self.matmul_fwd + self.attention / 3 + self.elementwise_fwd + self.host_fwd

    @property
    def backward(self) -> float:
        return self.matmul_bwd + self.attention * 2 / 3 + self.elementwise_bwd + self.host_bwd


def dtype_on(hw: Hardware, precision: str, fp8: bool = False) -> str:
    """The dtype a GEMM runs in, as the device has it: fp8 only for fp8 linears; fp16 as
    bf16 where the device lists no fp16 (a CPU calibration)."""
    want = "fp8" if fp8 else "fp32" if precision == "fp32" else "fp16" if precision == "fp16" else "bf16"
    for d in (want, "bf16", "fp32"):
        if d in hw.matmul:
            return d
    raise ValueError(f"{hw.name} has no matmul curve for {want}")


class WorkWalk:
    """Reads recordings on one plan: `rules` a Walker (its placement rules and batch)."""

    def __init__(self, rules: Walker, hw: Hardware, precision: str, span: int, compiled: bool,
                 policy: Policy):
        self.rules, self.hw, self.precision, self.span, self.compiled = rules, hw, precision, span, compiled
        self.policy = policy
        self._layouts: dict = {}
        self._works: dict[int, tuple] = {}  # id(recording) -> (the recording, held so the id stays its own; Work)
        # An eager step on a sharded mesh dispatches each op through DTensor and the
        # runtime's hooks; a compiled one runs its graph's kernels.
        self.launch = hw.sharded_launch_s if rules.mesh.world > 1 and not compiled else hw.launch_s

    def late(self, seconds: float) -> float:
        """What the host adds to a kernel of `seconds` on the device: its launch where the
        host runs the kernels (a CPU), else whatever the launch outlasts the kernel."""
        return max(0.0, self.launch - seconds) if self.hw.host_overlap else self.launch

    def _local(self, shape, layout) -> int:
        pls = self._layouts.get(layout)
        if pls is None:
            pls = self._layouts[layout] = self.rules.layout(layout)
        return local_numel(shape, pls, self.rules.mesh)

    def recording(self, rec) -> Work:
        """One recorded stretch's work (each once: a pipeline's stages share their blocks')."""
        if id(rec) not in self._works:
            self._works[id(rec)] = (rec, self._work(rec))
        return self._works[id(rec)][1]

    def _work(self, rec) -> Work:
        work = Work()
        for p in rec.linears:
            work += self._linear(p)
        for e in rec.events:
            if isinstance(e, Attend):
                work += self._attention(e)
            elif isinstance(e, Experts):
                work += self._experts(e)
        return work + self._elementwise(rec.kernels)

    def _elementwise(self, kernels) -> Work:
        """The ops' bytes at the memory bandwidth, each kernel at least a launch; backward
        BACKWARD_BYTES x the bytes in twice the kernels. Compiled: fused (module docstring)."""
        hw = self.hw
        seconds = [hw.memory_seconds(sum(i * self._local(shape, lay) for shape, i, lay in k)) for k in kernels]
        if self.compiled and seconds:
            fused = max(1, math.ceil(len(seconds) * COMPILED_KERNELS))
            seconds = [sum(seconds) * COMPILED_BYTES / fused] * fused
        fwd, bwd = sum(seconds), BACKWARD_BYTES * sum(seconds)
        late = sum(self.late(t) for t in seconds)
        late_bwd = sum(2 * self.late(t * BACKWARD_BYTES / 2) for t in seconds)
        return Work(elementwise_fwd=fwd, elementwise_bwd=bwd, host_fwd=late, host_bwd=late_bwd,
                    host_elementwise_fwd=late, kernels=len(seconds))

    def _linear(self, p) -> Work:
        pp = self.plan.params[p.name]
        n, k = local_shape(pp.spec.shape, self.rules.compute(p.name), pp.mesh)[:2]
        m = self._local(p.shape, p.layout) // max(n, 1)
        return self._gemm(m, n, k, dtype_on(self.hw, self.precision, self.policy.fp8_recipe(p.name) is not None),
                          pp.spec.trainable)

    @property
    def plan(self):
        return self.rules.plan

    def _gemm(self, m: int, n: int, k: int, dtype: str, trainable: bool = True, times: int = 1) -> Work:
        mm = self.hw.matmul_seconds
        fwd, dgrad = mm(m, n, k, dtype), mm(m, k, n, dtype)
        wgrad = mm(n, k, m, dtype) if trainable else 0.0
        late_bwd = self.late(dgrad) + (self.late(wgrad) if trainable else 0.0)
        return Work(matmul_fwd=times * fwd, matmul_bwd=times * (dgrad + wgrad), wgrad=times * wgrad,
                    host_fwd=times * self.late(fwd), host_bwd=times * late_bwd, kernels=times,
                    flops=times * 2.0 * m * n * k * (3 if trainable else 2))

    def _attention(self, e: Attend) -> Work:
        rows = self._local(e.q, ("act", QUERY)) // e.q[-1]
        keys = min(self.span, e.k[1])
        flops = 3 * 2.0 * rows * keys / 2 * (e.k[-1] + e.v[-1])
        # cp's exchanges attend through parallel/cp_blocks.py's kernels, not SDPA
        seconds = self.hw.attention_seconds(flops, keys, dtype_on(self.hw, self.precision),
                                            blocks=self.rules.mesh.size("cp") > 1)
        return Work(attention=seconds, host_fwd=self.late(seconds / 3), host_bwd=self.late(seconds * 2 / 3), kernels=1,
                    flops=flops)

    def _experts(self, e: Experts) -> Work:
        """The local experts' SwiGLUs on the rows routed to them, and the fp32 router."""
        m, rules = e.moe, self.rules
        em = rules.param_mesh(e.expert)
        ep = em.size("ep") if "ep" in em.axes else 1
        local_experts = max(1, m.num_experts // ep)
        load = MOE_LOAD[m.balance] if m.capacity_factor is None else min(MOE_LOAD[m.balance], m.capacity_factor)
        rows = math.ceil(routed_rows(rules, m) * load / local_experts)  # per local expert, the busiest
        ffn = m.expert_ffn_dim // (em.size("tp") if rules.moe_tp_split(e.expert) else 1)
        dtype = dtype_on(self.hw, self.precision)
        work = self._gemm(rows, ffn, e.dim, dtype, times=2 * local_experts)  # gate and up
        work += self._gemm(rows, e.dim, ffn, dtype, times=local_experts)  # down
        tokens = local_numel((rules.B, rules.S), rules.act(TOKENS), rules.mesh)
        return work + self._gemm(tokens, m.num_experts, e.dim, dtype_on(self.hw, "fp32"))


def local_shape(shape, pls, mesh) -> list[int]:
    """Per-dim sizes on the most loaded rank of a tensor with placements `pls` (a split of
    a dim the tensor lacks counts for nothing)."""
    size = list(shape)
    for i, p in enumerate(pls):
        if p[0] == "S" and p[1] < len(size):
            size[p[1]] = math.ceil(size[p[1]] / mesh.size(mesh.axes[i]))
    return size


def local_numel(shape, pls, mesh) -> int:
    return math.prod(local_shape(shape, pls, mesh))


def stretch_work(walk: WorkWalk, model, layers: list[int], embedding: bool, head: bool) -> tuple[Work, Work]:
    """(the blocks' work, the ends' work) of one micro-batch on a rank running `layers` and
    the embedding and head where it does: each kind of block recorded once (its first
    layer) and counted as many times as the rank runs it."""
    rules = walk.rules
    dtype = torch.float32 if walk.precision == "fp32" else torch.bfloat16
    moe = set(getattr(model.cfg, "moe_layers", ()) or ())
    blocks = Work()
    for kind in (False, True):
        ids = [i for i in layers if (i in moe) == kind]
        if ids:
            blocks += walk.recording(record_block(model, ids[0], rules.B, rules.S, dtype)).times(len(ids))
    front, back = record_ends(model, embedding, head, rules.B, rules.S, dtype, mtp=True)
    return blocks, walk.recording(front) + walk.recording(back)
