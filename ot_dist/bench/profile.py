"""Where a step's time goes: a few more steps, after the timed ones, under torch.profiler.

The timed steps say how fast a step is; this says what to change. Each op's own time (device time of the
kernels it launched on a GPU, CPU time on a CPU) is put in one category (matmuls, convolutions, attention,
normalisation, copies and casts, optimizer, communication, the rest), and on a GPU the kernels' total is set
against the wall time: a device busy far below 100 % means the step waits on the host (launch overhead, syncs),
which compile / CUDA graphs address, while a large "elementwise and other" share means memory-bound work that
fusion addresses. The steps run after the timed ones, so the profiler's overhead never reaches the figures.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch.autograd import DeviceType

# Checked in order: the first category that names an op (exactly, or by a word in its name) takes its time. The
# names are aten ops and the profiler's own labels, the same on CPU and CUDA.
CATEGORIES: tuple[tuple[str, frozenset[str], tuple[str, ...]], ...] = (
    # not "broadcast" alone: aten::broadcast_tensors is a view; c10d's broadcast is caught by "c10d"
    ("communication", frozenset(), ("nccl", "gloo", "c10d", "all_reduce", "allreduce", "all_gather",
                                    "allgather", "reduce_scatter")),
    ("attention", frozenset(), ("scaled_dot_product", "flash_attention", "efficient_attention", "cudnn_attention")),
    ("convolution", frozenset(), ("conv",)),
    ("matmul", frozenset({"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear",
                          "aten::_scaled_mm", "aten::addmv", "aten::mv", "aten::_addmm_activation"}),
     # compiled regions call these for the matmuls inductor leaves to cuBLAS / oneDNN
     ("gemm", "extern_kernels.mm", "extern_kernels.addmm", "extern_kernels.bmm", "extern_kernels.baddbmm")),
    ("normalization", frozenset(), ("group_norm", "layer_norm", "batch_norm", "rms_norm")),
    ("optimizer", frozenset(), ("_foreach_", "_fused_adam", "_fused_sgd", "optimizer.step", "optimizer.zero_grad")),
    ("copies and casts", frozenset({"aten::copy_", "aten::_to_copy", "aten::to", "aten::clone", "aten::contiguous",
                                    "aten::fill_", "aten::zero_"}), ("memcpy", "memset")),
)
OTHER = "elementwise and other"
CATEGORY_NAMES = tuple(name for name, _, _ in CATEGORIES) + (OTHER,)


def category_of(op_name: str) -> str:
    lowered = op_name.lower()
    for name, exact, words in CATEGORIES:
        if op_name in exact or any(word in lowered for word in words):
            return name
    return OTHER


@dataclass(frozen=True)
class StepProfile:
    steps: int
    device_kind: str  # "cuda" or "cpu": what the op times are (kernel time, or CPU time)
    wall_s_per_step: float
    op_s_per_step: dict[str, float]  # category -> seconds per step, in CATEGORY_NAMES order
    kernel_s_per_step: float | None  # every kernel's time on a GPU (attributed to an op or not); None on a CPU
    top_ops: str  # torch's table of the ops with the most own time
    # On a GPU: kernels launched per step, and torch's table of the ops with the most own host time. A step that
    # leaves the device waiting is paced by these (each op's dispatch, each launch).
    kernels_per_step: float | None = None
    top_host_ops: str = ""
    # The copies and casts by input shape: which tensors are copied (weights cast for autocast, activations
    # made contiguous), the lever when "copies and casts" is large.
    top_copies: str = ""

    @property
    def device_busy(self) -> float | None:
        """Kernel time over wall time on a GPU (kernels on several streams may overlap, so it can exceed 1)."""
        if self.kernel_s_per_step is None or self.wall_s_per_step <= 0:
            return None
        return self.kernel_s_per_step / self.wall_s_per_step

    def summary(self) -> dict:
        return {"steps": self.steps, "device_kind": self.device_kind, "wall_s_per_step": self.wall_s_per_step,
                "kernel_s_per_step": self.kernel_s_per_step, "device_busy": self.device_busy,
                "kernels_per_step": self.kernels_per_step, "op_s_per_step": self.op_s_per_step}

    def text(self, title: str) -> str:
        timed = "kernel time of each op" if self.device_kind == "cuda" else "CPU time of each op (self)"
        lines = [f"# profile: {title}", "",
                 f"{self.steps} steps after the timed ones; wall {self.wall_s_per_step:.4f} s per step"]
        if self.device_busy is not None:
            lines.append(f"device busy {100 * self.device_busy:.1f} % (kernels {self.kernel_s_per_step:.4f} s per "
                         f"step, {self.kernels_per_step:.0f} launches): the rest of the wall time the device waited "
                         f"on the host")
        total = sum(self.op_s_per_step.values()) or 1.0
        lines += ["", f"| category ({timed}) | s per step | share |", "|---|---|---|"]
        lines += [f"| {name} | {seconds:.4f} | {100 * seconds / total:.1f} % |"
                  for name, seconds in self.op_s_per_step.items()]
        lines += ["", "Ops with the most own time:", "", self.top_ops]
        if self.top_host_ops:
            lines += ["", "Ops with the most own host (CPU) time:", "", self.top_host_ops]
        if self.top_copies:
            lines += ["", "Copies and casts by input shape:", "", self.top_copies]
        return "\n".join(lines) + "\n"


def profile_steps(step: Callable[[], torch.Tensor], device: torch.device, steps: int,
                  trace_path: Path | None = None) -> StepProfile:
    """Run `steps` more training steps under torch.profiler and say where their time went."""
    from torch.profiler import ProfilerActivity, profile

    if steps < 1:
        raise ValueError("bench: --profile must be at least 1 step")
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize(device)
    with profile(activities=activities, record_shapes=True) as prof:
        begin = time.perf_counter()
        for _ in range(steps):
            step()
        if cuda:
            torch.cuda.synchronize(device)
        wall = time.perf_counter() - begin
    if trace_path is not None:
        prof.export_chrome_trace(str(trace_path))
    return summarize(prof.events(), steps, wall, cuda, prof.key_averages(),
                     prof.key_averages(group_by_input_shape=True))


COPY_OPS = ("aten::copy_", "aten::_to_copy", "aten::clone", "aten::contiguous")


def summarize(events, steps: int, wall_s: float, cuda: bool, averages, by_shape=None) -> StepProfile:
    """Categorise each op's own time. On a GPU that is the time of the kernels the op launched itself
    (`self_device_time_total`), so nothing is counted twice through nesting; kernels no op launched
    (e.g. by a library's own thread) are kept in the kernel total and shown as unattributed."""
    per_category = dict.fromkeys(CATEGORY_NAMES, 0.0)
    kernel_us = 0.0
    kernels = 0
    attributed_us = 0.0
    for event in events:
        if event.device_type == DeviceType.CPU:
            own_us = event.self_device_time_total if cuda else event.self_cpu_time_total
            per_category[category_of(event.name)] += own_us
            attributed_us += own_us if cuda else 0.0
        elif cuda:
            kernel_us += event.self_device_time_total
            kernels += 1
    if cuda and kernel_us > attributed_us:
        per_category["unattributed kernels"] = kernel_us - attributed_us
    sort_by = "self_device_time_total" if cuda else "self_cpu_time_total"
    return StepProfile(
        steps=steps, device_kind="cuda" if cuda else "cpu", wall_s_per_step=wall_s / steps,
        op_s_per_step={name: us / 1e6 / steps for name, us in per_category.items()},
        kernel_s_per_step=kernel_us / 1e6 / steps if cuda else None,
        top_ops=averages.table(sort_by=sort_by, row_limit=25, max_name_column_width=70),
        kernels_per_step=kernels / steps if cuda else None,
        top_host_ops=averages.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70)
        if cuda else "",
        top_copies=copies_by_shape(by_shape, cuda, steps) if by_shape is not None else "")


def copies_by_shape(by_shape, cuda: bool, steps: int, rows: int = 20) -> str:
    """The copy and cast ops by input shape, the costliest first, as a Markdown table. Written here rather than with
    torch's `EventList.table`: that table divides each row's device time by the device time of the *kernel* rows
    in the list, and a list of ops alone has none, so on a GPU it fails its own assertion."""
    copies = [event for event in by_shape if event.key in COPY_OPS]
    if not copies:
        return ""

    def own_us(event) -> float:
        return event.self_device_time_total if cuda else event.self_cpu_time_total

    copies.sort(key=own_us, reverse=True)
    where = "device" if cuda else "host"
    lines = [f"| op | Input Shapes | calls per step | own {where} ms per step |", "|---|---|---|---|"]
    lines += [f"| {event.key} | {event.input_shapes} | {event.count / steps:g} | {own_us(event) / 1e3 / steps:.3f} |"
              for event in copies[:rows]]
    return "\n".join(lines)
