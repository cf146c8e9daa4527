"""The MoE layer on sharded tokens: routing on this rank's tokens, the router's balance and
z-loss terms reduced over the ranks that split them, experts on their ep ranks
(all-to-all, parallel/expert_parallel.py) with their mlp dim split over tp."""

from __future__ import annotations

import torch
from torch._prims_common import make_contiguous_strides_for
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from ..models.moe import balance_loss, route, routed_experts, sequence_stats, z_loss
from .expert_parallel import AllToAllExchange, CopyToTensorParallel


class ShardedMoe:
    """ShardedContext's `moe` and `moe_aux`. Reads the context's `mesh`; records the
    auxiliary terms in its `_moe` (models.context.MoeRecords). `moe` also runs with a
    checkpointed block's own records as `self` (models.context `_OwnRecords`)."""

    def moe(self, h: DTensor, cfg, router: DTensor, bias: DTensor | None, w_gate: DTensor, w_up: DTensor,
            w_down: DTensor) -> DTensor:
        """Routing on this rank's tokens; experts on their ep ranks (all-to-all) with their
        mlp dim split over tp. The per-sequence balance sums are added up over cp (the
        ranks that split a sequence), the load and z-loss over every token-splitting axis."""
        mesh, placements = self.mesh, h.placements
        token_dims = [i for i, p in enumerate(placements) if isinstance(p, Shard)]
        x = h.to_local()
        b, s, d = x.shape
        n = cfg.num_experts
        # Each rank's tokens give the router a partial gradient over the token-splitting dims.
        # (`router` stays referenced: while it lives, the regather hook knows its gathered
        # storage, so what linear saves of it is fetched again in backward, not kept.)
        local_router = router.to_local(grad_placements=[Partial() if i in token_dims else p
                                                        for i, p in enumerate(router.placements)])
        logits = torch.nn.functional.linear(x.float(), local_router.float())
        idx, gates, probs = route(logits.flatten(0, 1), cfg, None if bias is None else bias.to_local())
        prob_sum, counts = sequence_stats(probs.view(b, s, n), idx.view(b, s, cfg.top_k), n)
        balance = z = None
        if cfg.balance == "aux":
            per_sequence = [Partial() if p == Shard(1) else p for p in placements]
            shape = (h.shape[0], n)
            sums = [DTensor.from_local(t, mesh, per_sequence, run_check=False, shape=shape,
                                       stride=make_contiguous_strides_for(shape)).redistribute(
                        mesh, [Replicate() if p.is_partial() else p for p in per_sequence])
                    for t in (prob_sum, counts)]
            balance = _replicated(balance_loss(sums[0], sums[1], h.shape[1], cfg).sum())
        tokens = [Partial() if i in token_dims else Replicate() for i in range(mesh.ndim)]
        if cfg.z_loss_coef:
            z = DTensor.from_local(z_loss(logits, cfg), mesh, tokens, run_check=False).redistribute(
                mesh, [Replicate()] * mesh.ndim)
        self._moe.add(balance, z, DTensor.from_local(counts.sum(0), mesh, tokens, run_check=False))

        expert_mesh = w_gate.device_mesh
        names = expert_mesh.mesh_dim_names
        weights = [w.to_local(grad_placements=[Partial() if a in ("dp", "fsdp", "cp") else p
                                               for a, p in zip(names, w.placements)])
                   for w in (w_gate, w_up, w_down)]
        rows = x.reshape(-1, d)
        tp_split = "tp" in names and isinstance(w_gate.placements[names.index("tp")], Shard)
        if tp_split:
            group = expert_mesh.get_group("tp")
            rows, gates = CopyToTensorParallel.apply(rows, group), CopyToTensorParallel.apply(gates, group)
        exchange = AllToAllExchange(expert_mesh.get_group("ep"), expert_mesh.size(names.index("ep")), n) \
            if "ep" in names else None
        out = routed_experts(rows, idx, gates, *weights, cfg, exchange).view(b, s, d)
        out_placements = [Partial() if tp_split and a == "tp" else p
                          for a, p in zip(mesh.mesh_dim_names, placements)]
        return DTensor.from_local(out, mesh, out_placements, run_check=False, shape=h.shape,
                                  stride=make_contiguous_strides_for(h.shape))

    def moe_aux(self):
        return self._moe.take()


def _replicated(x: DTensor) -> DTensor:
    return x.redistribute(x.device_mesh, [Replicate()] * x.device_mesh.ndim)
