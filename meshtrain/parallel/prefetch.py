"""Prefetch in compiled steps: a graph pass that issues each parameter all-gather one
gather earlier, so it runs beside the compute between the two.

A traced functional collective is waited where it is issued, and a gather issued ahead
in Python would sit outside the checkpoint that recomputes it in backward (so it would be
kept), so the order is set on the compiled graphs instead (SimpleFSDP's way; TorchTitan
relies on inductor's reordering). In each forward and backward graph, the k-th
`all_gather_into_tensor` (with the packing ops that feed it from the graph's inputs)
moves to just after the wait of gather k - `depth`: block i+1's gather is in flight
during block i's compute in forward, and block i-1's during block i's in backward
(where resharding gathers again). Waits stay at first use.
"""

from __future__ import annotations

from functools import partial

import torch
from torch.fx import Graph, GraphModule, Node

_GATHER = torch.ops._c10d_functional.all_gather_into_tensor.default
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


def inductor_pass(depth: int):
    """`prefetch_gathers` as inductor's post-grad pass (a CustomGraphPass, keyed by this
    file and `depth`). Inductor is imported here, not with meshtrain."""
    from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

    class PrefetchPass(CustomGraphPass):
        def __call__(self, graph: Graph) -> None:
            prefetch_gathers(graph, depth)

        def uuid(self):
            return (get_hash_for_files((__file__,)), depth)

    return PrefetchPass()


def _prefetched(compiler, depth: int, gm: GraphModule, inputs):
    if prefetch_gathers(gm.graph, depth):
        gm.recompile()
    return compiler(gm, inputs)


def aot_eager_prefetched(depth: int):
    """The aot_eager backend with `prefetch_gathers` on its forward and backward graphs."""
    from torch._dynamo.backends.debugging import aot_eager, boxed_nop

    compiler = partial(_prefetched, boxed_nop, depth)
    return partial(aot_eager, fw_compiler=compiler, bw_compiler=compiler)
