"""What a device and its network can do: the clock a step-time model reads.

A `Hardware` is a small YAML file (`Hardware.load` / `dump`; docs/plan.md lists the keys)
or one of the built-ins (`BUILTINS`: h100, h200, b200, a100, SXM parts in nodes of 8).
Its methods give seconds for the pieces of a step:

- `matmul_seconds(m, n, k, dtype)`: achieved throughput saturates with the product's
  FLOPs f = 2mnk, tflops(f) = max_tflops * f / (f + half_flops), i.e. a fixed cost per
  product (half_flops / max) plus f / max: monotone in size and never above the peak.
  Shape enters through f only (a skinny product is modelled like a square one of equal
  FLOPs);
- `attention_seconds(flops, seq_len, dtype)`: causal attention, forward and backward, with
  `flops` the causal half actually computed; throughput max_tflops * s / (s + half_seq);
  context parallelism's block kernels at `block_attention`'s curve where it has one;
- `memory_seconds(nbytes)`: bytes read plus written at the memory bandwidth (element-wise,
  norms, the optimizer update);
- `launch_s`, `sharded_launch_s`: what the host spends per kernel (dispatch and launch),
  of a plain op and of an eager step's op on a sharded mesh (DTensor's dispatch and the
  runtime's hooks); with `host_overlap` (a GPU: the host issues kernels ahead) the
  step-time model counts it only where a kernel is shorter, else (a CPU, where the host
  runs the kernels) in full;
- `collective_seconds(op, nbytes, group_size, spans_nodes)`: the link level's latency and
  per-rank bandwidth through the ring algorithm (all_reduce optionally by tree); where
  `collective_table` holds what calibrate measured for that op on a group of that size
  inside a node, the measured seconds instead (linear between its points; past the
  largest, the link's bandwidth for the rest). A backend's time need not be a line in the
  bytes: gloo's all-gather here after compute costs 0.9 ms up to 256 KiB, 2.2 ms at 1 MiB;
- `comm_overlap`: the share of a collective beside compute that the compute hides (the
  step-time model's comm_time.beside);
- `sync_skew`: what a collective issued and waited at once adds per second of the compute
  before it: ranks drift apart between synchronisations and the first to arrive waits
  for the last (comm_time.skew_exposed).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import yaml

from ..errors import ConfigError

DTYPES = ("fp32", "bf16", "fp16", "fp8")
COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "send_recv")
LINK_LEVELS = ("intra_node", "inter_node")
ALGORITHMS = ("ring", "tree")
KEYS = ("name", "memory_bytes", "ranks_per_node", "peak_tflops", "matmul", "attention", "block_attention",
        "memory_bandwidth",
        "links", "collective_algorithm", "collective_table", "comm_overlap", "sync_skew", "launch_s",
        "sharded_launch_s", "host_overlap", "notes", "measured")
# When a file gives none (assumed): PyTorch's dispatch and launch of a plain op, and of an
# op of an eager step on a sharded mesh (DTensor's dispatch, the runtime's hooks).
LAUNCH_S, SHARDED_LAUNCH_S = 5e-6, 40e-6


@dataclass(frozen=True)
class Curve:
    """Achieved TFLOP/s saturating in `x`: max_tflops * x / (x + half) (half 0: flat)."""
    max_tflops: float
    half: float

    def tflops(self, x: float) -> float:
        return self.max_tflops * x / (x + self.half) if x > 0 else 0.0


@dataclass(frozen=True)
class Link:
    latency_s: float  # per algorithm step
    bandwidth: float  # bytes/s each rank sends (one direction)


@dataclass(frozen=True)
class Hardware:
    name: str
    memory_bytes: int
    ranks_per_node: int
    peak_tflops: dict[str, float]  # dense datasheet peak per dtype; a dtype absent: the device has none
    matmul: dict[str, Curve]  # over FLOPs per product (half_flops)
    attention: dict[str, Curve]  # over sequence length (half_seq)
    memory_bandwidth: float  # bytes/s
    links: dict[str, Link]  # intra_node, inter_node
    # cp's block kernels (parallel/cp_blocks.py), as attention; a dtype absent: the attention curve
    block_attention: dict[str, Curve] = field(default_factory=dict)
    collective_algorithm: str = "ring"  # how all_reduce scales: ring, or tree (log2 latency steps)
    # op -> {"ranks": n, "seconds_by_bytes": {bytes: s}}: measured inside a node, non-decreasing
    collective_table: dict = field(default_factory=dict)
    # Of a collective's time beside compute, the share the compute hides (1: all of it, a
    # GPU's copy engines and spare SMs, assumed; 0: none, a CPU whose cores the transport needs)
    comm_overlap: float = 1.0
    # Seconds a collective issued and waited at once adds per second of compute since the
    # last one (0 assumed: no data for the built-ins; calibrate measures it)
    sync_skew: float = 0.0
    launch_s: float = LAUNCH_S  # host seconds per kernel (dispatch and launch)
    sharded_launch_s: float = SHARDED_LAUNCH_S  # the same in an eager step on a sharded mesh
    host_overlap: bool = True  # the host issues kernels ahead of the device (a GPU); False: it runs them (a CPU)
    notes: str = ""
    measured: dict = field(default_factory=dict)  # calibrate's raw points, kept for the record

    def matmul_seconds(self, m: int, n: int, k: int, dtype: str) -> float:
        flops = 2.0 * m * n * k
        return flops / (self._curve(self.matmul, dtype, "matmul").tflops(flops) * 1e12) if flops else 0.0

    def attention_seconds(self, flops: float, seq_len: int, dtype: str, blocks: bool = False) -> float:
        """`blocks`: run by context parallelism's block kernels (block_attention, if given)."""
        curves = self.block_attention if blocks and dtype in self.block_attention else self.attention
        return flops / (self._curve(curves, dtype, "attention").tflops(seq_len) * 1e12) if flops else 0.0

    def memory_seconds(self, nbytes: float) -> float:
        return nbytes / self.memory_bandwidth

    def collective_seconds(self, op: str, nbytes: float, group_size: int, spans_nodes: bool) -> float:
        """One collective over `group_size` ranks. `nbytes`: the whole buffer (all_gather's
        output, reduce_scatter's input, all_reduce's buffer, what one rank's all_to_all
        sends in all, one send_recv's message)."""
        steps, share = collective_terms(op, group_size, self.collective_algorithm)
        link = self.links["inter_node" if spans_nodes else "intra_node"]
        if not steps:
            return 0.0
        table = self.collective_table.get(op)
        if table and table["ranks"] == (2 if op == "send_recv" else group_size) and not spans_nodes:
            return _interpolate(table["seconds_by_bytes"], nbytes, share / link.bandwidth)
        return steps * link.latency_s + nbytes * share / link.bandwidth

    def _curve(self, curves: dict, dtype: str, what: str) -> Curve:
        if dtype not in curves:
            raise ValueError(f"{self.name} has no {what} throughput for {dtype!r}: it has {', '.join(curves)}")
        return curves[dtype]

    @classmethod
    def load(cls, path) -> "Hardware":
        try:
            with open(path) as f:
                data = yaml.safe_load(f)
        except OSError as e:
            raise ConfigError(f"--hardware {path}: {e.strerror or e}") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"--hardware {path}: not valid YAML: {e}") from None
        return from_dict(data, where=f"--hardware {path}")

    def dump(self, path) -> None:
        with open(path, "w") as f:
            yaml.safe_dump(to_dict(self), f, sort_keys=False)


def collective_terms(op: str, n: int, algorithm: str = "ring") -> tuple[int, float]:
    """(latency steps, share of the buffer each rank sends) of `op` on n ranks. Ring:
    all_gather / reduce_scatter / all_to_all n-1 steps moving (n-1)/n, all_reduce (a
    reduce-scatter then an all-gather) 2(n-1) steps moving 2(n-1)/n; tree all_reduce the
    same bytes in 2 ceil(log2 n) steps; send_recv one step moving the message."""
    if op not in COLLECTIVES:
        raise ValueError(f"unknown collective {op!r}: choose from {', '.join(COLLECTIVES)}")
    if op == "send_recv":
        return 1, 1.0
    if n <= 1:
        return 0, 0.0
    if op == "all_reduce":
        steps = 2 * math.ceil(math.log2(n)) if algorithm == "tree" else 2 * (n - 1)
        return steps, 2.0 * (n - 1) / n
    return n - 1, (n - 1) / n


def _interpolate(points: dict, nbytes: float, per_byte: float) -> float:
    """Seconds at `nbytes` from measured {bytes: seconds}: the smallest point's below it,
    linear between points, the largest's plus `per_byte` for each byte past it."""
    sizes = sorted(points)
    if nbytes <= sizes[0]:
        return points[sizes[0]]
    for lo, hi in zip(sizes, sizes[1:]):
        if nbytes <= hi:
            return points[lo] + (points[hi] - points[lo]) * (nbytes - lo) / (hi - lo)
    return points[sizes[-1]] + (nbytes - sizes[-1]) * per_byte


def to_dict(hw: Hardware) -> dict:
    d = asdict(hw)
    d["matmul"] = {k: {"max_tflops": c.max_tflops, "half_flops": c.half} for k, c in hw.matmul.items()}
    for key in ("attention", "block_attention"):
        d[key] = {k: {"max_tflops": c.max_tflops, "half_seq": c.half} for k, c in getattr(hw, key).items()}
    return d


def _positive(value, key: str, where: str, unit: str, zero: bool = False) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and \
        (value >= 0 if zero else value > 0)
    if not ok:
        raise ConfigError(f"{where}: {key}={value!r}: give a {'non-negative' if zero else 'positive'} number ({unit})")
    return float(value)


def _share(value, key: str, where: str) -> float:
    if not (isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= 1):
        raise ConfigError(f"{where}: {key}={value!r}: give a share from 0 (hides nothing) to 1 (hides all)")
    return float(value)


def _flag(value, key: str, where: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{where}: {key}={value!r}: give true or false")
    return value


def _mapping(value, key: str, where: str, allowed: tuple[str, ...], what: str) -> dict:
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: {key} must be a mapping of {what} ({', '.join(allowed)})")
    for k in value:
        if k not in allowed:
            raise ConfigError(f"{where}: {key}.{k}: unknown {what}; choose from {', '.join(allowed)}")
    return value


def _curves(value, key: str, where: str, half_key: str, half_unit: str, dtypes) -> dict[str, Curve]:
    out = {}
    for dtype, c in _mapping(value, key, where, DTYPES, "dtype").items():
        if dtype not in dtypes:
            raise ConfigError(f"{where}: {key}.{dtype}: no peak_tflops.{dtype} to bound it; add one")
        c = _mapping(c, f"{key}.{dtype}", where, ("max_tflops", half_key), "key")
        for name in ("max_tflops", half_key):
            if name not in c:
                raise ConfigError(f"{where}: {key}.{dtype}.{name} is missing")
        top = _positive(c["max_tflops"], f"{key}.{dtype}.max_tflops", where, "TFLOP/s")
        if top > dtypes[dtype] * (1 + 1e-9):
            raise ConfigError(f"{where}: {key}.{dtype}.max_tflops={c['max_tflops']} is above peak_tflops.{dtype}="
                              f"{dtypes[dtype]}: no kernel beats the peak; lower it or raise the peak")
        out[dtype] = Curve(top, _positive(c[half_key], f"{key}.{dtype}.{half_key}", where, half_unit, zero=True))
    return out


def _table(value, where: str) -> dict:
    """collective_table: per op, the group size measured and its seconds by bytes, which
    must not fall as the bytes grow."""
    out = {}
    for op, t in _mapping(value, "collective_table", where, COLLECTIVES, "collective").items():
        key = f"collective_table.{op}"
        t = _mapping(t, key, where, ("ranks", "seconds_by_bytes"), "key")
        ranks, points = t.get("ranks"), t.get("seconds_by_bytes")
        if not isinstance(ranks, int) or isinstance(ranks, bool) or ranks < 2:
            raise ConfigError(f"{where}: {key}.ranks={ranks!r}: give the group size measured (2 or more)")
        if not isinstance(points, dict) or not points:
            raise ConfigError(f"{where}: {key}.seconds_by_bytes must map buffer bytes to seconds (one point or more)")
        table = {}
        for b, sec in points.items():
            if not isinstance(b, int) or isinstance(b, bool) or b < 1:
                raise ConfigError(f"{where}: {key}.seconds_by_bytes: {b!r} is not a positive whole number of bytes")
            table[b] = _positive(sec, f"{key}.seconds_by_bytes.{b}", where, "seconds", zero=True)
        times = [table[b] for b in sorted(table)]
        if any(later < earlier for earlier, later in zip(times, times[1:])):
            raise ConfigError(f"{where}: {key}.seconds_by_bytes falls as the bytes grow: a larger buffer never "
                              "takes less time; make it non-decreasing (calibrate writes it so)")
        out[op] = {"ranks": ranks, "seconds_by_bytes": table}
    return out


def from_dict(data, where: str = "hardware") -> Hardware:
    """A Hardware from the mapping of a YAML file, each bad key named in a ConfigError."""
    data = _mapping(data, "the file", where, KEYS, "key")
    optional = ("collective_algorithm", "collective_table", "comm_overlap", "sync_skew", "launch_s",
        "sharded_launch_s", "host_overlap", "notes", "measured", "attention", "block_attention")
    required = [k for k in KEYS if k not in optional]
    for key in required:
        if key not in data:
            raise ConfigError(f"{where}: {key} is missing (docs/plan.md lists the keys)")
    peak = {d: _positive(v, f"peak_tflops.{d}", where, "TFLOP/s")
            for d, v in _mapping(data["peak_tflops"], "peak_tflops", where, DTYPES, "dtype").items()}
    matmul = _curves(data["matmul"], "matmul", where, "half_flops", "FLOPs", peak)
    if set(matmul) != set(peak):
        raise ConfigError(f"{where}: matmul has no curve for {', '.join(sorted(set(peak) - set(matmul)))}: "
                          "give one for every dtype of peak_tflops")
    links = _mapping(data["links"], "links", where, LINK_LEVELS, "link level")
    for level in LINK_LEVELS:
        link = _mapping(links.get(level), f"links.{level}", where, ("latency_s", "bandwidth"), "key")
        if "latency_s" not in link or "bandwidth" not in link:
            raise ConfigError(f"{where}: links.{level} needs latency_s and bandwidth")
    algorithm = data.get("collective_algorithm", "ring")
    if algorithm not in ALGORITHMS:
        raise ConfigError(f"{where}: collective_algorithm={algorithm!r}: choose from {', '.join(ALGORITHMS)}")
    if not isinstance(data["name"], str) or not data["name"]:
        raise ConfigError(f"{where}: name={data['name']!r}: give the device a name")
    ranks = data["ranks_per_node"]
    if not isinstance(ranks, int) or isinstance(ranks, bool) or ranks < 1:
        raise ConfigError(f"{where}: ranks_per_node={ranks!r}: give a positive whole number")
    return Hardware(
        name=data["name"], memory_bytes=int(_positive(data["memory_bytes"], "memory_bytes", where, "bytes")),
        ranks_per_node=ranks, peak_tflops=peak, matmul=matmul,
        attention=_curves(data.get("attention") or {}, "attention", where, "half_seq", "tokens", peak),
        block_attention=_curves(data.get("block_attention") or {}, "block_attention", where, "half_seq", "tokens",
                                peak),
        memory_bandwidth=_positive(data["memory_bandwidth"], "memory_bandwidth", where, "bytes/s"),
        links={lv: Link(_positive(links[lv]["latency_s"], f"links.{lv}.latency_s", where, "seconds", zero=True),
                        _positive(links[lv]["bandwidth"], f"links.{lv}.bandwidth", where, "bytes/s per rank"))
               for lv in LINK_LEVELS},
        collective_algorithm=algorithm,
        collective_table=_table(data.get("collective_table") or {}, where),
        comm_overlap=_share(data.get("comm_overlap", 1.0), "comm_overlap", where),
        sync_skew=_positive(data.get("sync_skew", 0.0), "sync_skew", where, "seconds per second of compute",
                            zero=True),
        launch_s=_positive(data.get("launch_s", LAUNCH_S), "launch_s", where, "seconds per kernel", zero=True),
        sharded_launch_s=_positive(data.get("sharded_launch_s", SHARDED_LAUNCH_S), "sharded_launch_s", where,
                                   "seconds per kernel", zero=True),
        host_overlap=_flag(data.get("host_overlap", True), "host_overlap", where),
        notes=str(data.get("notes") or ""),
        measured=_mapping(data.get("measured") or {}, "measured", where, ("matmul", "attention", "block_attention",
                                                                          "memory", "collectives", "overlap", "sync",
                                                                          "host"),
                           "record"))
