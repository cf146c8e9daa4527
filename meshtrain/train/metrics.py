"""What a run reports: FLOPs and MFU, and where the numbers go (console, metrics.jsonl,
TensorBoard).

MFU = achieved model FLOP/s per device / the device's dense peak for the run's precision.
Model FLOPs per token = 6 x (weight-matrix parameters) + 12 x layers x dim x seq_len:
the first term is the forward (2) and backward (4) of every weight matmul (token and
position embedding lookups are not matmuls, nor are norm scales and biases; the output
head is, tied or not); the second
is the attention scores and the weighted sum of values, counted over the full square as
Megatron, TorchTitan and PaLM's appendix B do (causal masking does not reduce it).
Activation recomputation is not counted: it is hardware FLOPs, not model FLOPs.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import resource
import sys
from pathlib import Path

import torch

from ..errors import TrainingError

# Dense peak TFLOP/s per device (no sparsity), from the vendors' data sheets. fp32 runs on
# tensor cores as TF32. Devices missing here report no MFU.
PEAK_TFLOPS = {
    "H200": {"fp32": 494.7, "bf16": 989.4},
    "H100 SXM": {"fp32": 494.7, "bf16": 989.4},
    "H100 PCIe": {"fp32": 378.0, "bf16": 756.0},
    "A100": {"fp32": 156.0, "bf16": 312.0},
}

EMBEDDING_TABLES = ("tok_emb", "pos_emb")


def flops_per_token(specs: dict, n_layers: int, dim: int, seq_len: int, tied: bool, moe=None) -> float:
    """Model FLOPs to train on one token (forward + backward), as in the module docstring.
    Of the stacked expert weights a token uses top_k of num_experts."""
    matrices = sum(s.numel for n, s in specs.items() if len(s.shape) == 2 and n not in EMBEDDING_TABLES)
    experts = sum(s.numel for s in specs.values() if "experts" in s.axes)
    active = experts * moe.top_k / moe.num_experts if moe is not None else 0
    matmul = matrices + active + (specs["tok_emb"].numel if tied else 0)  # a tied head reuses the table
    return 6.0 * matmul + 12.0 * n_layers * dim * seq_len


def device_peak_tflops(device: torch.device, precision: str) -> float | None:
    """The dense peak MFU is counted against. fp8 runs count against the bf16 peak (as
    TorchTitan reports them): their attention, norms and head run in bf16, and fp8 and bf16
    MFU stay comparable (higher is faster)."""
    if device.type != "cuda":
        return None
    precision = "bf16" if precision == "fp8" else precision
    name = torch.cuda.get_device_name(device)
    for key in ("H200", "A100"):
        if key in name:
            return PEAK_TFLOPS[key].get(precision)
    if "H100" in name:
        return PEAK_TFLOPS["H100 PCIe" if "PCIe" in name else "H100 SXM"].get(precision)
    return None


def memory_gib(device: torch.device) -> float:
    """Peak memory of this process: device memory allocated on CUDA, resident set on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return kib / (2**30 if sys.platform == "darwin" else 2**20)


class Reporter:
    """Rank 0's outputs: a live console display (plain lines off a TTY), metrics.jsonl
    and TensorBoard when it is installed. On other ranks every call does nothing."""

    def __init__(self, enabled: bool, run_dir: Path, total_steps: int):
        self.enabled, self.total = enabled, total_steps
        self.console = self.live = self.tb = None
        self.path = run_dir / "metrics.jsonl"
        if not enabled:
            return
        from rich.console import Console

        self.console = Console(highlight=False, soft_wrap=True)
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # tensorboard is optional
            SummaryWriter = None
        if SummaryWriter is not None:
            self.tb = SummaryWriter(str(run_dir / "tensorboard"))

    def print(self, *args, **kwargs) -> None:
        if self.console is not None:
            (self.live.console if self.live else self.console).print(*args, **kwargs)

    def start(self, kept: list[dict]) -> None:
        """Begin writing metrics.jsonl with the records a resumed run keeps."""
        if not self.enabled:
            return
        # Replaced whole: a kill during the rewrite must not lose the records kept.
        tmp = self.path.with_name(self.path.name + ".tmp")
        with self._writing():
            with open(tmp, "w") as f:
                f.write("".join(json.dumps(r) + "\n" for r in kept))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        if self.console.is_terminal:
            from rich.live import Live

            self.live = Live(console=self.console, refresh_per_second=4, transient=False)
            self.live.start()

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        with self._writing(), open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self.tb.add_scalar(f"train/{key}" if not key.startswith("val_") else f"val/{key[4:]}",
                                       value, record["step"])
        line = format_record(record, self.total)
        if self.live is not None:
            self.live.update(_panel(record, self.total))
            if "val_loss" in record:  # evaluations stay on screen
                self.live.console.print(line)
        else:
            self.console.print(line)

    @contextlib.contextmanager
    def _writing(self):
        try:
            yield
        except OSError as e:
            raise TrainingError(f"cannot write {self.path} ({e.strerror or e}): the checkpoints already written are "
                                "intact; free space or make run_dir writable, then run the same command again to "
                                "resume from the latest") from None

    def close(self) -> None:
        if self.live is not None:
            self.live.stop()
            self.live = None
        if self.tb is not None:
            self.tb.close()


def format_record(r: dict, total: int) -> str:
    width = len(str(total))
    parts = [f"step {r['step']:>{width}}/{total}", f"loss {r['loss']:.4f}", f"lr {r['lr']:.3e}",
             f"grad_norm {r['grad_norm']:.3f}", f"tokens/s {r['tokens_per_s']:,.0f}"]
    if r.get("mfu") is not None:
        parts.append(f"mfu {100 * r['mfu']:.1f}%")
    if "aux_loss" in r:
        parts.append(f"aux_loss {r['aux_loss']:.4f}")
    if "expert_imbalance" in r:
        parts.append(f"expert_imbalance {r['expert_imbalance']:.2f}")
    parts.append(f"mem {r['memory_gib']:.2f} GiB")
    if "val_loss" in r:
        parts.append(f"val_loss {r['val_loss']:.4f} (ppl {r['val_ppl']:.2f})")
    parts.append(f"eta {_duration(r['eta_s'])}")
    return "  ".join(parts)


def _duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def _panel(r: dict, total: int):
    from rich.console import Group
    from rich.progress_bar import ProgressBar
    from rich.table import Table
    from rich.text import Text

    bar = Table.grid(padding=(0, 2))
    bar.add_row(ProgressBar(total=total, completed=r["step"], width=40), f"step {r['step']}/{total}",
                f"eta {_duration(r['eta_s'])}")
    return Group(bar, Text(format_record(r, total)))
