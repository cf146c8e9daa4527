"""What `meshtrain plan` prints (rich renderables, laid out for 80 columns): first the
verdict — parameters, world and mesh, peak memory per rank, whether it fits the GPU and
the layouts that do — then the detail: mesh, parameters (under pp, those of the most
loaded pp rank, so the table adds up to its memory), activation layouts, pipeline, memory
and collectives."""

from __future__ import annotations

from rich.table import Table

from .advice import nothing_fits
from ..layout.plan import without_pp
from ..layout.plan_table import activation_table, human_bytes, param_table
from .step_memory import HOST_KEYS, MEMORY_KEYS


def renderables(run) -> list:
    out = verdict(run)
    out += [f"[yellow]warning: {w}[/]" for w in run.warnings]
    out += [mesh_table(run), _params(run), activation_table(run.plan)]
    if run.pipeline is not None:
        out += _pipeline_renderables(run.pipeline)
    if run.keep_gathered is not None:
        out.append(_keep_gathered_line(run.keep_gathered))
    if run.zero_stages is not None:
        out.append(_zero_line(run.zero_stages))
    out += [_memory_table(run), _collectives_table(run)]
    if run.buckets is not None:
        out.append(_buckets_line(run.buckets))
    if run.expert_exchange is not None:
        out.append(_expert_line(run.expert_exchange))
    if run.time is not None:
        out.append(_time_table(run.time))
    if run.fastest is not None:
        out.append(_search_table(run))
    return out


def verdict(run) -> list:
    """The answer first: what the model is, where it runs, its peak, and whether it fits."""
    mesh = run.plan.mesh
    active = f" ({count(run.active_params)} active)" if run.active_params is not None else ""
    nodes = max(1, run.world // run.gpus_per_node)
    peak = run.memory["peak"]
    where = f"pp rank {run.memory['pp_rank']}, the most loaded" if "pp_rank" in run.memory else "the most loaded rank"
    lines = [f"[bold]{count(run.total_params)} parameters[/]{active}: {run.model}", f"step: {run.setup}",
             f"world {run.world} = {nodes} node(s) x {run.gpus_per_node} GPUs, mesh "
             + " x ".join(f"{a}={mesh.size(a)}" for a in mesh.axes),
             f"peak memory {human_bytes(peak)} per rank ({where})"]
    if run.compute:
        lines.append(_compute_line(run.compute))
    if run.time is not None:
        lines.append(_time_line(run.time))
    if run.gpu is None:
        return ["\n".join(lines + ["add --gpu h100 (or h200, b200, a100), or --hardware FILE, to check it "
                                   "against a device"])]
    capacity = run.gpu_memory
    device = f"{run.gpu} ({capacity / 1e9:.0f} GB)"
    if run.fits:
        return ["\n".join(lines + [f"[bold green]fits on {device}[/]: peak {human_bytes(peak)} of "
                                   f"{human_bytes(capacity)} ({peak / capacity:.0%})"])]
    lines.append(f"[bold red]does NOT fit on {device}[/]: peak {human_bytes(peak)} of {human_bytes(capacity)}")
    if not run.advice:
        return ["\n".join(lines + nothing_fits(run.search, run.lowest, run.would_fit, run.world))]
    lines.append(f"layouts that fit at world {run.world}, fastest first by the modelled step (add the flags):")
    advice = Table(box=None, show_header=False, pad_edge=False, padding=(0, 1))
    advice.add_column(justify="right", no_wrap=True)
    advice.add_column(justify="right", no_wrap=True)
    advice.add_column(overflow="fold")
    for fit in run.advice:
        speed = f"{fit.tokens_per_s_per_gpu:,.0f} tokens/s/GPU" if fit.tokens_per_s_per_gpu is not None else ""
        advice.add_row(f"  {human_bytes(fit.peak)}", speed, fit.flags or "(the layout given)")
    return ["\n".join(lines), advice]


def _time_line(t: dict) -> str:
    """The modelled step: seconds, tokens/s per GPU, MFU, on which device."""
    mfu = f", MFU {t['mfu']:.0%}" if t["mfu"] is not None else ""
    where = t["hardware"] if t["hardware_given"] else f"{t['hardware']}, assumed: give --gpu or --hardware"
    return (f"step time {_seconds(t['step_s'])} ({where}): {t['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU"
            f"{mfu}")


def _seconds(s: float) -> str:
    return f"{s:.3g} s" if s >= 1 else f"{s * 1e3:.3g} ms"


def _time_table(t: dict) -> Table:
    """Where the modelled step's time goes (step_time.py), adding up to the step."""
    table = Table(title=f"step time on {t['hardware']} (modelled)", title_justify="left")
    table.add_column("part")
    table.add_column("time", justify="right")
    table.add_column("share", justify="right")
    step = t["step_s"]
    for part, value in t["breakdown"].items():
        rows = [(f"exposed comm {a}", s) for a, s in value.items()] if isinstance(value, dict) else \
            [(part.replace("_", " "), value)]
        for name, s in rows:
            if s > 0:
                table.add_row(name, _seconds(s), f"{s / step:.1%}")
    table.add_row("[bold]step[/]", f"[bold]{_seconds(step)}[/]", "100%")
    return table


def _search_table(run) -> Table | str:
    """--search: the fastest layouts that fit, as the flags that make them."""
    s = run.searched
    title = (f"fastest layouts on {run.time['hardware']} at world {run.world} (modelled; {s['candidates']} "
             f"planned, {s['fitting']} fit, {s['timed']} timed in full)")
    if not run.fastest:
        return f"{title}: none fits"
    table = Table(title=title, title_justify="left")
    for name, justify in (("tokens/s/GPU", "right"), ("MFU", "right"), ("step", "right"), ("peak", "right"),
                          ("flags to add", "left")):
        table.add_column(name, justify=justify, overflow="fold")
    for r in run.fastest:
        table.add_row(f"{r.tokens_per_s_per_gpu:,.0f}", f"{r.mfu:.0%}" if r.mfu is not None else "-",
                      _seconds(r.step_s), human_bytes(r.peak), r.flags or "(the layout given)")
    return table


def _compute_line(c: dict) -> str:
    """The step's model FLOPs, and the attention's share of them over documents."""
    line = (f"model FLOPs {c['step_flops_per_rank'] / 1e12:,.1f} TFLOP per rank per step "
            f"({_gflop(c['model_flops_per_token'])} GFLOP per token, attention "
            f"{c['attention_flops_per_token'] / c['model_flops_per_token']:.0%})")
    whole = c["attention_flops_per_token_whole_row"]
    if c["attention_flops_per_token"] < whole:
        line += (f"; documents of {c['attention_span']} tokens: attention "
                 f"{c['attention_flops_per_token'] / whole:.2g}x of the whole row's")
    return line


def _gflop(flops: float) -> str:
    g = flops / 1e9
    return f"{g:,.0f}" if g >= 100 else f"{g:.3g}"


def count(n: int) -> str:
    """A parameter count the way papers write it: 405.9B, 46.7B, 5.6M."""
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


def mesh_table(run) -> Table:
    mesh = run.plan.mesh
    nodes = max(1, run.world // run.gpus_per_node)
    head = Table(title=f"mesh: world {run.world} = {nodes} node(s) x {run.gpus_per_node} ranks")
    for col in ("axis", "size", "rank stride", "one group spans"):
        head.add_column(col, justify="right" if col != "axis" else "left")
    for axis in mesh.axes:
        span = run.axis_nodes[axis]
        head.add_row(axis, str(mesh.size(axis)), str(mesh.stride(axis)),
                     "one node" if span == 1 else f"{span} nodes")
    return head


def _params(run) -> Table:
    """The parameter table; under pp, the most loaded pp rank's stages on its stage mesh,
    the parameters (and bytes) its memory counts."""
    plan, mesh = run.plan, run.plan.mesh
    if run.pipeline is None:
        return param_table(plan, title="parameters: mesh " + " x ".join(f"{a}={mesh.size(a)}" for a in mesh.axes))
    rank = run.memory["pp_rank"]
    stages = [st for st in run.pipeline.stages if st.rank == rank]
    names = {n for st in stages for n in st.params + st.shared}
    sub = without_pp(plan)
    layers = ", ".join(f"{st.layers[0]}..{st.layers[1] - 1}" for st in stages)
    return param_table(sub, names, title=f"parameters of pp rank {rank} (the most loaded; layers {layers}): "
                                         "stage mesh " + " x ".join(f"{a}={sub.mesh.size(a)}" for a in sub.mesh.axes))


def _memory_table(run) -> Table:
    title = "memory of the most loaded rank"
    if run.pipeline is not None:
        title += f" (pp rank {run.memory['pp_rank']})"
    memory = Table(title=title)
    memory.add_column("")
    memory.add_column("bytes", justify="right")
    for key in MEMORY_KEYS:
        if key == "peak":  # kept weights' share of it (parallel.zero 1/2, pp_keep_gathered), where they are
            for kept in ("kept_weights", "kept_grads", "micro_grads"):
                if run.memory.get(kept):
                    memory.add_row(kept, human_bytes(run.memory[kept]))
        memory.add_row(key, human_bytes(run.memory[key]))
    for host in HOST_KEYS:  # offloaded to host memory: beside the device's, not in its peak
        if run.memory.get(host):
            memory.add_row(f"{host} (host memory)", human_bytes(run.memory[host]))
    if run.gpu:
        memory.add_row(f"{run.gpu} capacity", human_bytes(run.gpu_memory))
    return memory


def _collectives_table(run) -> Table:
    title = "collectives per step (bytes per rank)"
    if run.pipeline is not None:
        title = f"collectives per step (bytes per rank; pp rank {run.pipeline.busiest['pp_rank']}, the busiest)"
    comms = Table(title=title)
    for col in ("axis", "op", "phase", "count", "bytes"):
        comms.add_column(col, justify="right" if col in ("count", "bytes") else "left")
    for c in run.collectives:
        comms.add_row(c["axis"], c["op"], c["phase"], f"{c['count']:,}", human_bytes(c["bytes"]))
    return comms


def _buckets_line(b: dict) -> str:
    """parallel.bucket's buckets (dryrun.bucket_summary), under the collectives they set."""
    unit = f"{b['unit']:g} MB" if isinstance(b["unit"], float) else b["unit"]
    if not b["count"]:
        return f"parameter traffic: parallel.bucket {unit}, one collective per parameter"
    return (f"parameter traffic: parallel.bucket {unit}, {b['count']:,} buckets (each gathered and reduced by one "
            f"collective per mesh group), the largest {human_bytes(b['largest_bytes'])}")


def _pipeline_renderables(est) -> list:
    s, t = est.schedule, est.timing
    stages = Table(title=f"pipeline: {s.pp} ranks x {s.v} stage(s) each, schedule {s.name}, {s.m} micro-batches")
    for col in ("stage", "pp rank", "layers", "holds", "GFLOP / micro-batch"):
        stages.add_column(col, justify="right" if col in ("stage", "pp rank", "GFLOP / micro-batch") else "left")
    for st in est.stages:
        holds = [k for k, on in (("embedding", st.has_embedding), ("head+loss", st.has_head)) if on]
        holds += [f"shares {n}" for n in st.shared]
        stages.add_row(str(st.index), str(st.rank), f"{st.layers[0]}..{st.layers[1] - 1}", ", ".join(holds),
                       f"{st.flops / 1e9:,.1f}")
    ranks = Table(title="per pp rank (simulated with FLOP-proportional stage costs)")
    for col in ("pp rank", "layers", "peak in flight", "peak memory", "bytes moved"):
        ranks.add_column(col, justify="right")
    for r in est.ranks:
        ranks.add_row(str(r["pp_rank"]), str(r["layers"]), str(t.peak_in_flight[r["pp_rank"]]),
                      human_bytes(r["memory"]["peak"]), human_bytes(sum(c["bytes"] for c in r["collectives"])))
    lines = [f"timeline (compute actions per rank in order; F forward, B backward, I/W its input/weight halves; "
             f"stage.micro): simulated bubble {t.bubble:.1%}"]
    lines += est.to_dict()["timeline"]
    return [stages, ranks, "\n".join(lines)]


def _keep_gathered_line(sides: dict) -> str:
    """parallel.pp_keep_gathered off and on (dryrun.keep_gathered_sides): each side's
    highest peak and that rank's parameter traffic per step; the configured side marked."""
    lines = ["parallel.pp_keep_gathered, each way the pp rank with the highest peak:"]
    for name in ("off", "on"):
        s = sides[name]
        label = f"{name} (set)" if name == sides["configured"] else name
        lines.append(f"  {label:<9}  peak {human_bytes(s['peak_bytes'])} (pp rank {s['pp_rank']}), "
                     f"parameter traffic {human_bytes(s['param_bytes'])}/step")
    return "\n".join(lines)


def _zero_line(stages: dict) -> str:
    """parallel.zero 1, 2 and 3 (dryrun.zero_sides): each stage's peak and collective bytes
    per step; the configured one marked."""
    lines = ["parallel.zero, each stage on this layout:"]
    for zero in ("1", "2", "3"):
        s = stages[zero]
        label = f"{zero} (set)" if int(zero) == stages["configured"] else zero
        lines.append(f"  {label:<7}  peak {human_bytes(s['peak_bytes'])}, collectives "
                     f"{human_bytes(s['collective_bytes'])}/step")
    return "\n".join(lines)


def _expert_line(x: dict) -> str:
    """The ep all-to-alls of one MoE layer in one micro-step (comms.expert_exchange)."""
    return (f"expert all-to-all over ep ({x['ep']} ranks; {x['moe_layers']} MoE layers), per MoE layer per "
            f"micro-step at uniform routing: {x['all_to_alls']} calls, {human_bytes(x['bytes'])} per rank\n"
            f"  = {x['rows']:,} routed rows x {human_bytes(x['row_bytes'])}, dispatched and combined, forward and "
            f"backward, + {human_bytes(x['counts_bytes'])} of counts; ~{human_bytes(x['leaving_bytes'])} "
            f"((ep-1)/ep) leaves the rank")
