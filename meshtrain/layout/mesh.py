"""Named device mesh: sizes per axis, -1 fill, and the torch DeviceMesh built from them."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import ClassVar

from ..errors import ConfigError

# How context-parallel attention exchanges keys and values (parallel/cp_exchanges.py).
CP_COMMS = ("allgather", "ring", "a2a")
# The pipeline schedules a plan can name (pipeline/schedule.py builds each).
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb")

# Outer to inner: tp innermost so it stays within a node, pp outermost.
MESH_AXES = ("pp", "dp", "fsdp", "cp", "tp")
# Axes whose parameter shards are gathered before use (storage-only sharding, ZeRO-3
# style). cp ranks hold the same weights and see different tokens, exactly as fsdp ranks
# do, so the fsdp shard group may include cp (Megatron and TorchTitan fold them alike).
GATHERED_AXES = ("fsdp", "cp")
# Expert weights live on the same ranks refolded: fsdp x cp becomes fsdp x ep (ep inner,
# so an ep group is drawn from cp ranks first, then fsdp ranks), as Megatron's folding.
EXPERT_AXES = ("pp", "dp", "fsdp", "ep", "tp")


@dataclass(frozen=True)
class MeshSpec:
    """Sizes of the named mesh axes. One axis may be -1: it takes the remaining ranks.

    ep (experts) is folded from fsdp x cp, as Megatron's parallel folding does, so it is
    not a factor of the world size.
    """

    # The axes this mesh's dims are drawn from, in rank order (ExpertMeshSpec: ep for cp).
    ORDER: ClassVar[tuple[str, ...]] = MESH_AXES

    pp: int = 1
    dp: int = 1
    fsdp: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1

    def resolve(self, world: int) -> "MeshSpec":
        """Sizes with -1 filled for `world` ranks; ConfigError if they cannot multiply to it."""
        sizes = {a: getattr(self, a) for a in MESH_AXES}
        for axis, n in {**sizes, "ep": self.ep}.items():
            if n == 0 or n < -1:
                raise ConfigError(f"parallel.{axis}={n}: sizes must be positive, or -1 to fill")
        fill = [a for a, n in sizes.items() if n == -1]
        if len(fill) > 1:
            raise ConfigError(f"parallel: only one axis may be -1 (it takes the remaining ranks), got "
                              f"{', '.join(f'parallel.{a}=-1' for a in fill)}; give all but one of them a "
                              "fixed size")
        known = math.prod(n for n in sizes.values() if n != -1)
        if fill:
            if world % known:
                fixed = " x ".join(f"{a}={n}" for a, n in sizes.items() if n > 1) or "all 1"
                keys = " x ".join(f"parallel.{a}" for a, n in sizes.items() if n > 1 or known == 1)
                raise ConfigError(f"parallel.{fill[0]}=-1 cannot fill world size {world}: the fixed axes "
                                  f"{fixed}{f' ({keys})' if keys else ''} multiply to {known}, which does not "
                                  f"divide {world}; change "
                                  f"the sizes so that their product divides {world}, or start more processes "
                                  "(parallel.nproc_per_node, or the launcher's)")
            sizes[fill[0]] = world // known
        elif known != world:
            described = " x ".join(f"{a}={n}" for a, n in sizes.items() if n > 1) or "all 1"
            keys = " x ".join(f"parallel.{a}" for a, n in sizes.items() if n > 1 or known == 1)
            raise ConfigError(f"parallel: axis sizes {described}{f' ({keys})' if keys else ''} multiply to "
                              f"{known}, but the world size is {world}; make them multiply to {world}, set one "
                              "axis to -1, or start that many processes (parallel.nproc_per_node, or the launcher's)")
        resolved = MeshSpec(**sizes, ep=self.ep)
        if self.ep > 1 and (resolved.fsdp * resolved.cp) % self.ep:
            raise ConfigError(f"parallel.ep={self.ep} must divide fsdp x cp = {resolved.fsdp} x {resolved.cp} = "
                              f"{resolved.fsdp * resolved.cp} (parallel.fsdp x parallel.cp: experts are sharded "
                              f"over ranks folded from fsdp and cp); choose an ep that divides "
                              f"{resolved.fsdp * resolved.cp}, or larger fsdp x cp")
        return resolved

    @property
    def world(self) -> int:
        return math.prod(getattr(self, a) for a in self.ORDER)

    def __post_init__(self):
        # Made once, here (the spec is frozen): the planners ask for them a hundred thousand
        # times a plan, and a lazy cache would be written inside a compiled step's trace,
        # which dynamo refuses under activation checkpointing. Sizes that do not compare
        # yet (a config not checked) are left to the properties.
        try:
            axes = self._axes_of()
            shape = tuple(getattr(self, a) for a in axes)
        except TypeError:
            axes = shape = None
        object.__setattr__(self, "_axes", axes)
        object.__setattr__(self, "_shape", shape)

    def _axes_of(self) -> tuple[str, ...]:
        return tuple(a for a in self.ORDER if getattr(self, a) > 1) or ("dp",)

    @property
    def axes(self) -> tuple[str, ...]:
        """The mesh dims that exist: axes of size > 1 in mesh order (a 1-rank mesh keeps dp)."""
        return self._axes if self._axes is not None else self._axes_of()

    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape if self._shape is not None else tuple(getattr(self, a) for a in self.axes)

    def size(self, axis: str) -> int:
        return getattr(self, axis)

    def stride(self, axis: str) -> int:
        """Rank distance between neighbours along `axis`: ranks are numbered in mesh order,
        tp innermost (sizes must be resolved)."""
        return math.prod(getattr(self, a) for a in MESH_AXES[MESH_AXES.index(axis) + 1:])

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    def experts(self) -> "MeshSpec":
        """The mesh expert weights live on: this one refolded (fsdp x cp -> fsdp x ep), or
        this one itself without expert parallelism. Sizes must be resolved."""
        if self.ep == 1:
            return self
        return ExpertMeshSpec(pp=self.pp, dp=self.dp, fsdp=self.fsdp * self.cp // self.ep, cp=1, tp=self.tp,
                              ep=self.ep)

    def build(self, device_type: str = "cpu"):
        """The DeviceMesh over the current process group (sizes must be resolved)."""
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device_type, self.shape, mesh_dim_names=self.axes)
        forget_earlier_meshes()
        return mesh


def sub_mesh(device_mesh, axes: tuple[str, ...]):
    """`device_mesh[axes]`, the same object on every call: two equal slices would each
    meet the other's placements through DTensor's caches (see forget_earlier_meshes), as
    a pipeline's evaluation and its step did."""
    memo = device_mesh.__dict__.setdefault("_meshtrain_sub_meshes", {})
    if axes not in memo:
        memo[axes] = device_mesh[axes]
    return memo[axes]


def forget_earlier_meshes() -> None:
    """Clear DTensor's sharding-propagation caches. They key on the DeviceMesh by value
    (its layout and names, not its process groups) and hand back output placements that
    hold the mesh they were first computed on; a graph traced on a new, equal mesh then
    finds among its outputs a mesh that is none of its inputs', which AOTAutograd takes
    from a tangent and refuses ("Node tangents_2 was invalid, but is output": Known gap
    13 in docs/parallelism.md)."""
    import torch
    from torch.distributed.tensor import DTensor

    clear = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if clear is not None:
        clear()
    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()


@dataclass(frozen=True)
class ExpertMeshSpec(MeshSpec):
    """The expert mesh: the dense mesh's ranks in the same order with fsdp x cp refolded
    as fsdp x ep; its ep axis is a real mesh dim."""

    ORDER: ClassVar[tuple[str, ...]] = EXPERT_AXES


def device_mesh_for(device_mesh, spec: MeshSpec):
    """The DeviceMesh of `spec` on the ranks of the dense `device_mesh`: the mesh itself,
    or its expert refolding (built once per mesh: building makes process groups, a
    collective call every rank must make in the same order)."""
    names = tuple(device_mesh.mesh_dim_names or ())
    if not isinstance(spec, ExpertMeshSpec) or names == spec.axes:
        return device_mesh
    folded = getattr(device_mesh, "_meshtrain_experts", None)
    if folded is None:
        from torch.distributed.device_mesh import DeviceMesh

        # A pipeline stage's sub-mesh: refold the whole mesh (pp kept outermost), so every
        # rank builds the same process groups, then take this stage group's slice.
        root = device_mesh._get_root_mesh()
        pp = root.size(0) if root is not device_mesh and "pp" in (root.mesh_dim_names or ()) else 1
        shape, axes = ((pp, *spec.shape), ("pp", *spec.axes)) if pp > 1 else (spec.shape, spec.axes)
        folded = DeviceMesh(root.device_type, root.mesh.reshape(shape), mesh_dim_names=axes)
        if pp > 1:
            folded = folded[spec.axes]
        device_mesh._meshtrain_experts = folded
    return folded

