"""The forward written down once, for the estimators: a ModelContext that runs a family's
own `forward_stage` on the meta device (shapes only: no memory, no process group) and
records, in parameter names and logical axes, what the parallel runtime will do with it.

Every `ctx` call is recorded (constrain, linear, embedding, attention, moe), and every
tensor operation in between is seen by a dispatch mode that follows where each tensor
came from: which parameter lookup it is a view or cast of, which `constrain` output it
views, and its layout. From that the recording knows, per parameter lookup, the layouts
of the activations it acts on (a gradient summed over the tokens is partial where they
are split) and how many tensors of it autograd keeps for backward (saved-tensor hooks:
each is gathered again in an eager backward); per `constrain`, where its input's layout
came from, which column-parallel linears read its output (their gradients arrive partial
over tp) and whether autograd keeps the output itself. Nothing here knows a mesh: layouts
are expressions a plan evaluates later (meshtrain/estimate/walker.py):

  ("act", axes)            the plan's layout of these logical axes (a constrain's output)
  ("linear", x, name)      ctx.linear's output on an input of layout x
  ("sum", a, b)            the sum of two tensors of different layouts
  ("lookup", ids, table)   ctx.embedding's rows, before their constrain
  ("moe", h, expert)       ctx.moe's routed output on the block input h

What the forward cannot show is declared by this context, as the runtime's answer to the
call: ctx.moe's expert weights are kept for backward and their gradients are summed over
the expert mesh's data axes; ctx.attention returns the query heads' layout."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from .family import RESIDUAL, ModelDef
from .policy import keeps_fp32

QUERY = ("batch", "seq", "q_heads", None)
_aten = torch.ops.aten
_MATMULS = {_aten.mm, _aten.addmm, _aten.bmm, _aten.baddbmm}  # the step-time model counts these from ctx.linear


@dataclass(eq=False)
class Use:
    """One parameter lookup `p[name]`. `reuse`: a kept table (ParamSpec.reused) looked up
    again, nothing gathered; its reads count towards the first lookup's `acts`. `saves`:
    tensors of it autograd keeps. `experts`: an expert weight that ctx.moe reads whole."""

    name: str
    reuse: bool
    saves: int = 0
    acts: list = field(default_factory=list)
    experts: bool = False


@dataclass(eq=False)
class Constrain:
    """ctx.constrain of a (global) `shape` from layout `src` to the logical `axes`;
    `consumers`: ctx.linear weights reading the output; `broadcast`: (layout, dims) of a
    wider operand the output was broadcast against over its leading `dims` dims."""

    shape: tuple
    src: tuple
    axes: tuple
    consumers: list = field(default_factory=list)
    broadcast: list = field(default_factory=list)
    packed: bool = False
    read: bool = False

    @property
    def saved(self) -> bool:
        """Autograd keeps the output: seen packed, or read by nothing recorded (the
        next block, another stage: assumed kept)."""
        return self.packed or not self.read


@dataclass(frozen=True)
class Attend:
    """ctx.attention on q, k, v of these global shapes (batch, seq, heads, head dim)."""

    q: tuple
    k: tuple
    v: tuple


@dataclass(frozen=True)
class Remat:
    """ctx.remat's region (a block) begins (`begin`) or ends: what activation
    checkpointing recomputes in backward."""

    begin: bool


@dataclass(frozen=True)
class Experts:
    """ctx.moe of the MoE config `moe` on block input layout `h` (width `dim`), whose
    expert weights start with `expert` (its w_gate)."""

    moe: object
    h: tuple
    dim: int
    expert: str


@dataclass(frozen=True)
class Saved:
    """A tensor autograd keeps for backward (one per storage: views of it count once):
    its global shape, dtype and layout; `const`: the logical axes of a table the forward
    builds itself and constrains (RoPE's, position ids: kept once per micro-batch);
    `src`: a constrain's output, the layout it came from (kept as that shard where the
    constrain gathers); `kernel`: "input" (q, k, v) or "output" of ctx.attention, whose
    kept tensors the runtime's kernel decides."""

    shape: tuple
    dtype: torch.dtype
    layout: tuple | None
    const: tuple | None
    src: tuple | None = None
    kernel: str | None = None


@dataclass(frozen=True)
class Product:
    """A ctx.linear call: its weight, its output's global shape and layout, and how many
    ctx.attention calls came before it in the stretch recorded."""

    name: str
    shape: tuple
    layout: tuple
    after_attention: int


@dataclass(frozen=True)
class Recording:
    """One stretch of a forward: its events in order (Use, Constrain, Attend, Experts, Remat),
    the layout of what it returned, what autograd keeps (`saved`) and its ctx.linear
    calls in order (`linears`)."""

    events: tuple
    out: tuple | None
    saved: tuple = ()
    linears: tuple = ()
    outs: tuple = ()  # further outputs' layouts (the multi-token prediction modules' logits)
    kernels: tuple = ()  # per op but matmuls and views: the activations it reads and writes (shape, itemsize, layout)


@dataclass
class _Info:
    layout: tuple | None = None  # None: a constant (not derived from the input or a parameter)
    origin: Constrain | None = None  # the constrain whose output this is, or a view of
    use: Use | None = None  # the parameter lookup this is, or a view or cast of
    base: torch.Tensor | None = None  # the tensor whose storage this views
    const: tuple | None = None  # axes of a constrained table the forward built
    given: bool = False  # the stage's input tokens: there before the forward
    kernel: str | None = None  # ctx.attention's output, or a view of it: "output"


def _on_meta(a):
    if isinstance(a, torch.Tensor) and not a.is_meta:
        return a.to("meta")
    return torch.device("meta") if isinstance(a, torch.device) and a.type == "cpu" else a


class _Provenance(TorchDispatchMode):
    """Follows every aten op of the forward: views keep their base's provenance; other
    ops record the parameters they read and give their output the layout of their
    widest activation input."""

    def __init__(self, rec: RecordingContext):
        super().__init__()
        self.rec = rec

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        # Shapes only: what the forward computes on the CPU (RoPE's tables) runs on meta too.
        args, kwargs = tree_map(_on_meta, (args, kwargs or {}))
        out = func(*args, **kwargs)
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if outs:
            info = self.rec.follow(func, ins) if ins else _Info()
            for t in outs:
                self.rec.mark(t, info if info.base is not None else replace(info, base=t))
            self.rec.kernel(func, ins, outs)
        return out


class RecordingContext:
    """The ModelContext that records (module docstring); `dtype` the compute dtype."""

    start_pos = 0

    def __init__(self, model: ModelDef, dtype: torch.dtype):
        self.model, self.dtype = model, dtype
        self.specs = _specs(model)
        self.events: list = []
        self.saved: dict[int, tuple[torch.Tensor, Saved]] = {}
        self.linears: list[Product] = []
        self.kernels: list[tuple] = []
        self._attends = 0  # ctx.attention calls so far
        self._info: dict[int, tuple[torch.Tensor, _Info]] = {}
        self._first: dict[str, Use] = {}

    # ---------------------------------------------------------------- provenance
    def info(self, t: torch.Tensor) -> _Info:
        kept = self._info.get(id(t))
        return kept[1] if kept is not None and kept[0] is t else _Info()

    def mark(self, t: torch.Tensor, info: _Info) -> torch.Tensor:
        self._info[id(t)] = (t, info)  # the tensor is held: its id stays its own
        return t

    def follow(self, func, ins: list[torch.Tensor]) -> _Info:
        infos = [self.info(t) for t in ins]
        if getattr(func, "is_view", False):
            return infos[0] if infos[0].base is not None else replace(infos[0], base=ins[0])
        acts = [(t, i) for t, i in zip(ins, infos) if i.layout is not None]
        widest = max((t.ndim for t, _ in acts), default=0)
        for t, i in acts:
            if i.origin is not None:
                i.origin.read = True
                if t.ndim < widest:
                    wider = next(j.layout for s, j in acts if s.ndim == widest)
                    i.origin.broadcast.append((wider, widest - t.ndim))
        uses = [i.use for i in infos if i.use is not None]
        for use in uses:
            self._owner(use).acts.extend(i.layout for _, i in acts)
        if not acts:  # a parameter's cast or product: still that parameter
            return _Info(use=uses[0] if len(uses) == 1 else None)
        layouts = list(dict.fromkeys(i.layout for t, i in acts if t.ndim == widest))
        return _Info(layout=functools.reduce(lambda a, b: ("sum", a, b), layouts))

    def _owner(self, use: Use) -> Use:
        return self._first[use.name] if use.reuse else use

    def _pack(self, t: torch.Tensor, kernel: str | None = None) -> torch.Tensor:
        info = self.info(t)
        if info.use is not None:
            info.use.saves += 1
        if info.origin is not None:
            info.origin.packed = True
        if info.use is None and not info.given:
            base = info.base if info.base is not None else t
            src = info.origin.src if info.origin is not None else None
            saved = Saved(tuple(base.shape), base.dtype, info.layout, info.const, src, kernel or info.kernel)
            self.saved.setdefault(id(base), (base, saved))
        return t

    def _new(self, shape, layout, dtype=None, origin=None) -> torch.Tensor:
        t = torch.empty(shape, dtype=dtype or self.dtype, device="meta", requires_grad=True)
        return self.mark(t, _Info(layout=layout, origin=origin, base=t))

    def ids(self, batch: int, seq_len: int) -> torch.Tensor:
        """Token ids given to the forward (there before it: not kept, not placed)."""
        return self.mark(torch.empty((batch, seq_len), dtype=torch.int64, device="meta"), _Info(given=True))

    def residual(self, batch: int, seq_len: int) -> torch.Tensor:
        """The residual stream (batch, seq_len, dim) arriving from an earlier stretch."""
        return self._new((batch, seq_len, self.model.cfg.dim), ("act", RESIDUAL))

    def run(self, fn, *args):
        """fn(*args) recorded: every op followed, every saved tensor seen."""
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t), _Provenance(self):
            return fn(*args)

    # ---------------------------------------------------------------- the ModelContext
    def bind(self, params):
        return _Lookups(self)

    def lookup(self, name: str) -> torch.Tensor:
        spec = self.specs[name]
        use = Use(name, reuse=name in self._first and spec.reused)
        if not use.reuse:
            self._first[name] = use
        self.events.append(use)
        dtype = spec.dtype if keeps_fp32(name) or self.dtype == torch.float32 else self.dtype
        t = torch.empty(spec.shape, dtype=dtype, device="meta", requires_grad=spec.trainable)
        return self.mark(t, _Info(use=use, base=t))

    def constrain(self, x, axes):
        axes = tuple(axes)
        before = self.info(x)
        if before.layout is None:  # a constant (token ids, RoPE tables): placed without communication
            out = torch.empty(x.shape, dtype=x.dtype, device="meta")
            const = None if before.given else axes
            return self.mark(out, _Info(layout=("act", axes), base=out, const=const, given=before.given))
        record = Constrain(tuple(x.shape), before.layout, axes)
        self.events.append(record)
        return self._new(x.shape, ("act", axes), x.dtype, origin=record)

    def recording(self, out: torch.Tensor, since: tuple[int, ...] = (0, 0, 0, 0)) -> Recording:
        """What was recorded after `since` (a `mark_point()`), `out` being what it returned."""
        events, saved, linears, kernels = since
        return Recording(tuple(self.events[events:]), self.info(out).layout,
                         tuple(s for _, s in list(self.saved.values())[saved:]), tuple(self.linears[linears:]),
                         kernels=tuple(self.kernels[kernels:]))

    def mark_point(self) -> tuple[int, ...]:
        return len(self.events), len(self.saved), len(self.linears), len(self.kernels)

    def kernel(self, func, ins, outs):
        """An op other than a view or a matmul: the activations it reads and writes, for the
        step-time model's element-wise work (estimate/step_work.py); parameters and
        constants (tables the forward builds) are left out."""
        if getattr(func, "is_view", False) or func.overloadpacket in _MATMULS:
            return
        touched = tuple((tuple(t.shape), t.dtype.itemsize, self.info(t).layout) for t in (*ins, *outs)
                        if self.info(t).layout is not None)
        if touched:
            self.kernels.append(touched)

    def linear(self, x, params, name, bias=None):
        w = params[name]
        info = self.info(x)
        if info.origin is not None:
            info.origin.consumers.append(name)
        out = F.linear(x, w, bias)
        layout = ("linear", info.layout, name)
        self.linears.append(Product(name, tuple(out.shape), layout, self._attends))
        return self.mark(out, _Info(layout=layout))

    def embedding(self, ids, table):
        out = F.embedding(ids, table)
        return self.mark(out, _Info(layout=("lookup", self.info(ids).layout, self.info(table).use.name)))

    def remat(self, fn, *args):
        self.events.append(Remat(True))
        out = fn(*args)
        self.events.append(Remat(False))
        return out

    def cached_latents(self, latent, rope_key):
        return latent, rope_key

    def attention(self, q, k, v, segments=None, window=None):
        for t in (q, k, v):  # the kernel keeps its inputs (and its output and log-sum-exp)
            self._pack(t, "input")
            if self.info(t).origin is not None:
                self.info(t).origin.read = True
        self.events.append(Attend(tuple(q.shape), tuple(k.shape), tuple(v.shape)))
        self._attends += 1
        out = self._new((*q.shape[:-1], v.shape[-1]), ("act", QUERY), q.dtype)
        self.info(out).kernel = "output"
        return out

    def moe(self, h, cfg, router, bias, w_gate, w_up, w_down):
        # The runtime's router: fp32 logits of every token (the fp32 h itself is kept).
        logits = F.linear(h.float(), router.float())
        if bias is not None:  # added to the scores to choose experts: nothing kept
            logits = logits + bias
        for w in (w_gate, w_up, w_down):  # the experts' grouped matmuls keep their weights
            use = self.info(w).use
            use.experts, use.saves = True, use.saves + 1
        layout = self.info(h).layout
        self.events.append(Experts(cfg, layout, h.shape[-1], self.info(w_gate).use.name))
        return self._new(h.shape, ("moe", layout, self.info(w_gate).use.name), h.dtype)

    def moe_aux(self):
        return None


class _Lookups:
    """The bound parameters: each `p[name]` is a recorded lookup."""

    def __init__(self, ctx: RecordingContext):
        self._ctx = ctx

    def __getitem__(self, name):
        return self._ctx.lookup(name)


_CACHE: dict = {}


def cached(key, make):
    """`make()` once per key (a model's specs, a recording of one stretch at a batch,
    length and dtype, its cost terms): the estimators ask again for every stage and
    layout of a plan (the oldest goes past 256)."""
    if key not in _CACHE:
        if len(_CACHE) >= 256:
            _CACHE.pop(next(iter(_CACHE)))
        _CACHE[key] = make()
    return _CACHE[key]


def _specs(model: ModelDef) -> dict:
    return cached((model.family.name, model.cfg, "specs"), lambda: model.specs)
