"""`step_collectives` (estimate/comms.py) in the shape of a recorded step
(support/collectives.py): both as (phase, op, axis) -> (count, bytes), and their comparison.
"""

from __future__ import annotations

from meshtrain.estimate.comms import PHASES, step_collectives
from meshtrain.layout.mesh import MeshSpec
from meshtrain.layout.plan import make_plan
from meshtrain.layout.rules import Rules
from meshtrain.layout.traffic import Traffic

# estimate/comms.py's phase names -> the recorder's (fwd, bwd, opt)
SHORT = {v: k for k, v in PHASES.items()}


def totals(msgs) -> dict[tuple, tuple[int, int]]:
    """Recorded messages as (phase, op, axis) -> (count, bytes), as `estimate` gives them."""
    out: dict[tuple, list[int]] = {}
    for m in msgs:
        t = out.setdefault((m.phase, m.op, m.axis), [0, 0])
        t[0] += 1
        t[1] += m.nbytes
    return {k: tuple(v) for k, v in out.items()}


def estimate(model, layout, *, bucket, sp, batch, seq, micro=1, world=2, precision="fp32", compiled=False,
             cp_comm="allgather", activation_checkpointing="none", optimizer="adamw", **traffic):
    """step_collectives as (phase, op, axis) -> (count, bytes); `bucket` always given.
    traffic: the other Traffic switches (prefetch, reshard_after_forward, fsdp_accumulate)."""
    plan = make_plan(model.specs, Rules.default(sp=sp), MeshSpec(**layout), world=world, cp_comm=cp_comm)
    got = step_collectives(plan, model, micro_batch_rows=batch, seq_len=seq, micro_steps=micro,
                           precision=precision, compiled=compiled, traffic=Traffic(bucket=bucket, **traffic),
                           activation_checkpointing=activation_checkpointing, optimizer=optimizer)
    keys = [(SHORT[e["phase"]], e["op"], e["axis"]) for e in got]
    assert len(set(keys)) == len(keys), "entries are not aggregated per (axis, op, phase)"
    return {k: (e["count"], e["bytes"]) for k, e in zip(keys, got)}


def assert_same(est: dict, rec: dict) -> None:
    """The estimate equals the recording; a failure lists every key that differs."""
    lines = [f"  {k}: estimate {est.get(k)}, recorded {rec.get(k)}"
             for k in sorted(set(est) | set(rec)) if est.get(k) != rec.get(k)]
    assert not lines, "estimate differs from the recorded step:\n" + "\n".join(lines)
