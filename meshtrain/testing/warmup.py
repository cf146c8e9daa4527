"""Imported once by meshtrain.testing's forkserver, before it forks any rank: traces one
tiny function with AOTAutograd, so the ranks of every launch start with dynamo's lazy
set-up done (about 1.5 s a process otherwise, paid by each rank of each compiled launch).
The ops run on a few elements, below any intra-op parallel region: a fork stays safe."""

import torch


def _warm() -> None:
    x = torch.ones(4, requires_grad=True)
    torch.compile(lambda t: (t * 2).sum(), backend="aot_eager", fullgraph=True)(x).backward()
    torch._dynamo.reset()


_warm()
