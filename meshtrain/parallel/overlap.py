"""Overlap in compiled steps: graph passes that move the parameter traffic's waits away
from its issues, so the collectives run beside compute.

A traced functional collective is waited where it is issued, and a gather issued ahead
in Python would sit outside the checkpoint that recomputes it in backward (so it would be
kept), so the order is set on the compiled graphs instead (SimpleFSDP's way; TorchTitan
relies on inductor's reordering), `depth` (parallel.prefetch) collectives ahead:

- `prefetch_gathers`: in each forward and backward graph, the k-th
  `all_gather_into_tensor` (with the packing ops that feed it from the graph's inputs)
  moves to just after the wait of gather k - `depth`: block i+1's gather is in flight
  during block i's compute in forward, and block i-1's during block i's in backward
  (where resharding gathers again). Waits stay at first use.
- `defer_reduction_waits`: in backward, the wait of the k-th gradient reduce-scatter
  (with the views that carve the gradients out of its result) moves to just after the
  issue of reduce-scatter k + `depth`, or to the graph's end: block i's reduction runs
  during block i-1's backward, at most `depth` + 1 in flight (the eager step's InFlight).
"""

from __future__ import annotations

from functools import partial

import torch
from torch.fx import Graph, GraphModule, Node

_GATHER = torch.ops._c10d_functional.all_gather_into_tensor.default
_REDUCE_SCATTER = torch.ops._c10d_functional.reduce_scatter_tensor.default
_WAIT = torch.ops._c10d_functional.wait_tensor.default
# What a gather's inputs may be built with to move ahead: packing, not compute.
_MOVABLE = {"view", "reshape", "_unsafe_view", "cat", "convert_element_type", "_to_copy", "clone", "contiguous",
            "constant_pad_nd", "full", "zeros", "new_zeros", "empty", "slice", "split", "split_with_sizes",
            "getitem", "permute", "t", "transpose", "expand", "squeeze", "unsqueeze", "alias", "detach",
            "select", "as_strided", "copy"}


def _name(node: Node) -> str:
    target = node.target
    return getattr(target, "__name__", str(target)).split(".")[0]


def prefetch_gathers(graph: Graph, depth: int = 1) -> int:
    """Move each parameter all-gather of `graph` up to just after the wait of the one
    `depth` before it (see the module docstring); returns how many moved. A parameter
    gather is one built from the graph's inputs by packing ops alone; the others (the
    activation gathers of sequence parallelism, context parallelism's K/V) stay, and are
    no anchor either."""
    if depth < 1:
        return 0
    chains = {}
    for node in graph.nodes:
        if node.target is _GATHER:
            chain = _chain(node)
            if chain is not None:
                chains[node] = chain
    gathers = list(chains)
    moved = 0
    for k in range(depth, len(gathers)):
        order = {n: i for i, n in enumerate(graph.nodes)}
        waits = [u for u in gathers[k - depth].users if u.target is _WAIT]
        if not waits:
            continue
        anchor = min(waits, key=order.get)
        if order[gathers[k]] < order[anchor]:
            continue
        cursor = anchor
        for node in sorted((n for n in chains[gathers[k]] if order[n] > order[anchor]), key=order.get):
            cursor.append(node)
            cursor = node
        moved += 1
    return moved


def _chain(gather: Node) -> set[Node] | None:
    """The gather and the ops that build its input from the graph's inputs, if all of
    them are packing ops (else None)."""
    chain, todo = set(), [gather]
    while todo:
        node = todo.pop()
        if node in chain or node.op in ("placeholder", "get_attr"):
            continue
        if node is not gather and (node.op != "call_function" or _name(node) not in _MOVABLE):
            return None
        chain.add(node)
        todo.extend(node.all_input_nodes)
    return chain


def defer_reduction_waits(graph: Graph, depth: int = 1) -> int:
    """Move the wait of each gradient reduce-scatter of `graph` (one whose result only
    views carry to the graph's outputs) down to just after the issue of the one `depth`
    after it, or to just before the output (see the module docstring); returns how many
    moved. Other reduce-scatters (sequence parallelism's, in backward) feed compute and
    stay."""
    if depth < 1:
        return 0
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    tails = {}
    for node in graph.nodes:
        if node.target is _REDUCE_SCATTER:
            waits = [u for u in node.users if u.target is _WAIT]
            tail = _tail(waits[0], output) if len(waits) == 1 and len(node.users) == 1 else None
            if tail is not None:
                tails[node] = tail
    issues = list(tails)
    moved = 0
    for k, issue in enumerate(issues):
        target = issues[k + depth].next if k + depth < len(issues) else output
        order = {n: i for i, n in enumerate(graph.nodes)}
        tail = sorted(tails[issue], key=order.get)
        if order[target] <= order[tail[0]]:
            continue
        for node in tail:
            target.prepend(node)
        moved += 1
    return moved


def _tail(wait: Node, output: Node) -> set[Node] | None:
    """The wait and the views that carry its result to `output`, if that is all its
    result reaches (else None)."""
    tail, todo = set(), [wait]
    while todo:
        node = todo.pop()
        if node in tail:
            continue
        if node is not wait and (node.op != "call_function" or _name(node) not in _MOVABLE
                                 or len(node.all_input_nodes) != 1):
            return None
        tail.add(node)
        todo.extend(u for u in node.users if u is not output)
    return tail


def overlap(graph: Graph, depth: int) -> int:
    """Both passes on `graph`; returns how many collectives moved."""
    return prefetch_gathers(graph, depth) + defer_reduction_waits(graph, depth)


def inductor_pass(depth: int):
    """The passes as inductor's post-grad pass (a CustomGraphPass, keyed by this file and
    `depth`). Inductor is imported here, not with meshtrain."""
    from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

    class OverlapPass(CustomGraphPass):
        def __call__(self, graph: Graph) -> None:
            overlap(graph, depth)

        def uuid(self):
            return (get_hash_for_files((__file__,)), depth)

    return OverlapPass()


def _compile_overlapped(compiler, depth: int, gm: GraphModule, inputs):
    if overlap(gm.graph, depth):
        gm.recompile()
    return compiler(gm, inputs)


def aot_eager_overlapped(depth: int):
    """The aot_eager backend with the passes on its forward and backward graphs."""
    from torch._dynamo.backends.debugging import aot_eager, boxed_nop

    compiler = partial(_compile_overlapped, boxed_nop, depth)
    return partial(aot_eager, fw_compiler=compiler, bw_compiler=compiler)
