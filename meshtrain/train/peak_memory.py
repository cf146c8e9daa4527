"""Measured peak memory of a CPU computation, from torch's own allocation events.

`peak_cpu_bytes(fn, *args)` runs `fn` under `torch.profiler` with `profile_memory=True`,
which records every allocation and free made by torch's CPU allocator (size, pointer,
time). Walking those events in time order with a running sum of live bytes gives the
exact peak of what `fn` allocated and still held at any moment, e.g. the activations
saved for backward plus the gradients being built.

Limits:
- Only torch CPU tensor storage made through torch's allocator is seen (eager ops,
  inductor-compiled kernels, autograd, torch.utils.checkpoint): not Python objects, not
  numpy buffers, not memory that C libraries (oneDNN scratch, OpenMP) take themselves.
- Frees of blocks allocated before `fn` started are not counted (the profiler does not
  report most of them), so when `fn` frees pre-existing tensors the figure is an upper
  bound on the true peak above the starting level; for a step that only allocates and
  frees its own tensors it is exact.
- The peak is of bytes requested (storage nbytes), not of pages the OS maps.
- Profiling slows `fn` (every op is recorded) and takes some memory itself, off the books;
  use it for measurements, not inside a timed loop.
"""

from __future__ import annotations

from typing import Any, Callable

from torch.profiler import ProfilerActivity, profile


def peak_cpu_bytes(fn: Callable[..., Any], *args: Any, before: str | None = None) -> tuple[Any, int]:
    """(fn(*args), peak bytes live in torch's CPU allocator while fn ran, above the level
    when it started: the largest running total of the allocations fn made minus those it
    freed). `before`: only until the first region of that name (torch.profiler's
    record_function) starts, e.g. "optimizer" for a train step's forward and backward."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn(*args)
    events = _allocation_events(prof)
    if before is not None:
        start = min((n.start_time_ns for n in _nodes(prof) if n.name == before), default=None)
        if start is None:
            raise ValueError(f"no profiler region named {before!r} ran")
        events = [e for e in events if e[0] < start]
    return result, peak_from_events(events)


def held_cpu_bytes(fn: Callable[..., Any], *args: Any) -> tuple[Any, int]:
    """(fn(*args), bytes that fn allocated in torch's CPU allocator and still holds when
    it returns): after a forward, what autograd keeps for backward plus the outputs.
    A block freed by another thread (one whose last reference a gloo worker drops after
    a collective) has no free event and counts as held: measure collectives on the fake
    process group, which runs them on the calling thread."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn(*args)
    return result, held_from_events(_allocation_events(prof))


def held_from_events(events: list[tuple[int, int, int]]) -> int:
    """The running sum of `peak_from_events` at the end of the events."""
    live: dict[int, int] = {}
    for _, ptr, size in sorted(events, key=lambda e: (e[0], e[2] < 0)):
        if size > 0:
            live[ptr] = size
        else:
            live.pop(ptr, None)
    return sum(live.values())


def peak_from_events(events: list[tuple[int, int, int]]) -> int:
    """Peak of the running sum over (time_ns, ptr, signed bytes) allocation events (frees
    negative), counting only frees of blocks allocated within the events. At equal times
    allocations come first, so a tie can only raise the figure."""
    live: dict[int, int] = {}
    current = peak = 0
    for _, ptr, size in sorted(events, key=lambda e: (e[0], e[2] < 0)):
        if size > 0:
            live[ptr] = size
            current += size
            peak = max(peak, current)
        elif ptr in live:
            current -= live.pop(ptr)
    return peak


def _nodes(prof: profile):
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        yield node


def _allocation_events(prof: profile) -> list[tuple[int, int, int]]:
    from torch._C._profiler import _EventType

    out = []
    for node in _nodes(prof):
        if node.tag == _EventType.Allocation:
            fields = node.extra_fields
            if fields.device.type == "cpu" and fields.alloc_size != 0:
                out.append((node.start_time_ns, fields.ptr, fields.alloc_size))
    return out
