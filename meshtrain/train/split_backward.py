"""Zero-bubble's split of a compiled pipeline stage's backward into its input-gradient
and weight-gradient halves.

A compiled stage is one autograd node, so the eager split (torch.distributed.pipelining's
walk over the autograd graph, op by op) cannot see inside it. The split is made on the
stage's backward graph instead, when AOTAutograd hands it to the compiler: the input half
is every op the stage input's gradient depends on; the weight half is every other op,
fed by the graph's inputs it reads and by the input half's values it reads (kept, like
the eager split keeps the autograd graph, until the weight half runs). Each half is
compiled as its own graph by the backend the step names.

At run time the pipeline drives the node through the autograd engine twice:
- BI: `backward(..., inputs=[x], retain_graph=True)` under `split.input_half(key)`: the
  node runs the input half, keeps what the weight half needs under `key`, and returns
  the input gradient (the weight slots get zero placeholders the engine drops: they lead
  to no requested input);
- BW: `backward(..., inputs=weights)` under `split.weight_half(key)`: the node runs the
  weight half from what BI kept and returns the weight gradients, which the engine
  accumulates into the parameters as a whole backward would (DTensor placements
  included: AOTAutograd wraps them).
Outside both (any other schedule, or the first stage, whose input takes no gradient) the
node runs both halves at once.
"""

from __future__ import annotations

import contextlib
import operator
from functools import partial

import torch
from torch.fx import Graph, GraphModule, Node

from ..errors import ConfigError
from ..parallel.overlap import inductor_pass, overlap

_INPUT = "x"  # the stage function's argument that carries the previous stage's activation


class SplitBackward:
    """The halves' shared state for one pipeline rank: which half the next compiled
    backward runs, and what each (stage, micro-batch) input half left for its weight half."""

    def __init__(self):
        self.half, self.key, self.kept = None, None, {}
        self.halves: list[tuple[GraphModule, GraphModule]] = []  # (input, weight) graphs, in compile order

    @contextlib.contextmanager
    def _running(self, half: str, key):
        self.half, self.key = half, key
        try:
            # The graphs were compiled without donated buffers (see _compile): the check
            # AOTAutograd makes of a kept graph at the first backward does not apply.
            with torch._functorch.config.patch(donated_buffer=False):
                yield
        finally:
            self.half, self.key = None, None

    def input_half(self, key):
        return self._running("input", key)

    def weight_half(self, key):
        return self._running("weight", key)

    def backend(self, compile: bool | str, prefetch: int):
        """A dynamo backend: `compile`'s ("inductor" for True, or "aot_eager") with the
        backward graph split; `prefetch` as for train.step.compiled."""
        backend = "inductor" if compile is True else compile
        if backend not in ("inductor", "aot_eager"):
            raise ConfigError(f"train.compile {compile!r} with the zero-bubble schedule: its split backward needs "
                              "inductor or aot_eager")
        return partial(self._compile, backend, prefetch)

    def _compile(self, backend: str, prefetch: int, gm: GraphModule, example_inputs):
        # BI keeps the node's graph for BW (retain_graph), so its backward may not reuse
        # the saved buffers as its own (AOTAutograd's donated buffers).
        with torch._functorch.config.patch(donated_buffer=False):
            return self._compile_kept(backend, prefetch, gm, example_inputs)

    def _compile_kept(self, backend: str, prefetch: int, gm: GraphModule, example_inputs):
        sources = [n.meta["grapharg"].source for n in gm.graph.nodes if n.op == "placeholder"]
        x_at = {i for i, s in enumerate(sources) if type(s).__name__ == "LocalSource" and s.local_name == _INPUT}
        if backend == "aot_eager":
            from torch._dynamo.backends.debugging import aot_eager, boxed_nop

            def fw(g, inputs):
                if overlap(g.graph, prefetch):
                    g.recompile()
                return boxed_nop(g, inputs)

            def bw(g, inputs):
                overlap(g.graph, prefetch)
                return self._split(g, x_at, lambda part, ins: boxed_nop(part, ins))

            return aot_eager(gm, example_inputs, fw_compiler=fw, bw_compiler=bw)
        from torch._inductor.compile_fx import compile_fx, compile_fx_inner

        def inner(g, inputs, **kwargs):
            if not kwargs.get("is_backward"):
                return compile_fx_inner(g, inputs, **kwargs)
            kwargs = {**kwargs, "static_input_idxs": ()}
            return self._split(g, x_at, lambda part, ins: compile_fx_inner(part, ins, **kwargs))

        patches = {"post_grad_custom_post_pass": inductor_pass(prefetch), "reorder_for_peak_memory": False} \
            if prefetch else None
        with torch._functorch.config.patch(enable_autograd_cache=False):  # the halves are not one cacheable graph
            return compile_fx(gm, example_inputs, inner_compile=inner, config_patches=patches)

    def _split(self, gm: GraphModule, x_at: set[int], compile_part):
        output = gm.graph.output_node()
        outs, descs = list(output.args[0]), output.meta.get("desc")
        if descs is None or len(descs) != len(outs):
            raise ConfigError("the zero-bubble split of a compiled stage: this torch does not describe its backward's "
                              "outputs; use train.compile false or another pipeline schedule")
        slots = [_slot(o, d, x_at) for o, d in zip(outs, descs)]
        halves = _halves(gm.graph, outs, slots)
        self.halves.append((halves.first, halves.second))
        first = compile_part(halves.first, [n.meta["val"] for n in halves.first_inputs])
        second = compile_part(halves.second, [n.meta["val"] for n in halves.second_inputs])
        return _Runner(self, halves, first, second, outs, slots)


def _slot(out, desc, x_at: set[int]) -> str | None:
    """What a backward output is: None (no gradient), "opaque" (a subclass's non-tensor
    attribute, such as a DTensor's mesh, passed through from an input), "input" (a
    gradient of the stage's input) or "weight"."""
    if not isinstance(out, Node):
        return None
    if not isinstance(out.meta.get("val"), torch.Tensor):
        if out.op != "placeholder":
            raise ConfigError(f"the zero-bubble split of a compiled stage: backward output {out.name} is neither a "
                              "tensor nor an input; use train.compile false or another pipeline schedule")
        return "opaque"
    while hasattr(desc, "base"):  # a subclass's inner tensor: the gradient it is part of
        desc = desc.base
    of = getattr(desc, "grad_of", None)
    while hasattr(of, "base"):
        of = of.base
    plain = type(of).__name__ == "PlainAOTInput"
    return "input" if plain and of.idx in x_at else "weight"


def _zero(spec) -> torch.Tensor:
    """A zero of a gradient's (shape, dtype, device), holding no memory; made when run (the
    compiler may run under a fake-tensor mode)."""
    shape, dtype, device = spec
    return torch.zeros((), dtype=dtype, device=device).expand(shape)


class _Halves:
    """The two graphs and how the whole backward's inputs feed them."""

    def __init__(self, first: GraphModule, first_inputs: list[Node], second: GraphModule, second_inputs: list[Node],
                 placeholders: list[Node], n_first_outs: int):
        self.first, self.first_inputs, self.second, self.second_inputs = first, first_inputs, second, second_inputs
        self.placeholders = placeholders
        index = {n: i for i, n in enumerate(placeholders)}
        self.first_args = [index[n] for n in first_inputs]
        self.passed = [index[n] for n in second_inputs if n in index]  # the whole graph's inputs the weight half reads
        self.n_first_outs = n_first_outs


def _halves(graph: Graph, outs: list, slots: list) -> _Halves:
    """Split `graph` into the ops its input-gradient outputs depend on, and the rest."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    wanted = [o for o, s in zip(outs, slots) if s == "input"]
    weight_outs = [o for o, s in zip(outs, slots) if s == "weight"]
    first, todo = set(), list(wanted)
    while todo:
        node = todo.pop()
        if node not in first:
            first.add(node)
            todo.extend(node.all_input_nodes)
    # A multi-output op's parts go with it: only tensors cross between the halves.
    first |= {n for n in graph.nodes if n.target is operator.getitem and n.args[0] in first}
    second = [n for n in graph.nodes if n.op not in ("placeholder", "output") and n not in first]
    read = {i for n in second for i in n.all_input_nodes} | set(weight_outs)
    passed = [n for n in placeholders if n in read]
    kept = [n for n in graph.nodes if n in read and n in first and n.op != "placeholder"]
    first_inputs = [n for n in placeholders if n in first]
    first_graph = _graph(first_inputs, [n for n in graph.nodes if n in first and n.op != "placeholder"],
                         wanted + kept)
    return _Halves(first_graph, first_inputs, _graph(passed + kept, second, weight_outs), passed + kept,
                   placeholders, len(wanted))


def _graph(inputs: list[Node], nodes: list[Node], outputs: list) -> GraphModule:
    """A graph module of `nodes` (in order) over placeholders for `inputs`, returning `outputs`."""
    new = Graph()
    env = {}
    for node in inputs:
        env[node] = new.placeholder(node.name)
        env[node].meta = dict(node.meta)
    for node in nodes:
        env[node] = new.node_copy(node, lambda n: env[n])
    new.output(tuple(env[o] if isinstance(o, Node) else o for o in outputs))
    return GraphModule(torch.nn.Module(), new)


class _Runner:
    """The compiled backward AOTAutograd calls (boxed: a list of the graph's inputs)."""

    def __init__(self, split: SplitBackward, halves: _Halves, first, second, outs: list, slots: list):
        self._boxed_call = True  # in the instance's dict, which the wrappers around it copy
        self.split, self.halves, self.first, self.second, self.slots = split, halves, first, second, slots
        index = {n: i for i, n in enumerate(halves.placeholders)}
        self.opaque = {i: index[o] for i, (o, s) in enumerate(zip(outs, slots)) if s == "opaque"}
        self.zeros = [(o.meta["val"].shape, o.meta["val"].dtype, o.meta["val"].device) if s in ("input", "weight")
                      else None for o, s in zip(outs, slots)]

    def __call__(self, args: list):
        h, split = self.halves, self.split
        grads = [None] * len(self.slots)
        for i, j in self.opaque.items():
            grads[i] = args[j]
        if split.half == "weight":
            args.clear()
            return self._fill(grads, None, self.second(split.kept.pop(split.key)))
        first_args = [args[i] for i in h.first_args]
        passed = [args[i] for i in h.passed]
        args.clear()
        out = self.first(first_args)
        input_grads, kept = out[:h.n_first_outs], out[h.n_first_outs:]
        if split.half == "input":
            split.kept[split.key] = passed + list(kept)
            return self._fill(grads, input_grads, None)
        return self._fill(grads, input_grads, self.second(passed + list(kept)))

    def _fill(self, grads: list, input_grads, weight_grads) -> list:
        """One output per slot: the halves' gradients, zeros for the half not run (the
        engine drops them: they lead to no requested input)."""
        produced = {"input": iter(input_grads) if input_grads is not None else None,
                    "weight": iter(weight_grads) if weight_grads is not None else None}
        for i, slot in enumerate(self.slots):
            if slot in produced:
                source = produced[slot]
                grads[i] = next(source) if source is not None else _zero(self.zeros[i])
        return grads
