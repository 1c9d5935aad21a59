"""`ot-dist bench --profile N`: N more steps under torch.profiler after the timed ones, and where their time went
(per op category, the device's busy share on a GPU, the top ops, a trace)."""

from __future__ import annotations

import gzip
import json
from types import SimpleNamespace

import pytest
from torch.autograd import DeviceType

from ot_dist.bench.profile import CATEGORY_NAMES, category_of, summarize
from ot_dist.cli import main


def test_profile_runs_after_the_timed_steps_and_says_where_the_time_went(tmp_path):
    out = tmp_path / "bench"
    code = main(["bench", "--model", "tiny-sd15", "--method", "full", "--resolution", "32", "--batch-size", "2",
                 "--steps", "1", "--warmup", "0", "--dtype", "fp32", "--device", "cpu", "--no-flops",
                 "--profile", "2", "--out", str(out)])
    assert code == 0
    result = json.loads((out / "tiny-sd15-full-32-b2-fp32.json").read_text())
    assert len(result["step_times_s"]) == 1  # the profiled steps are not among the timed ones
    profile = result["profile"]
    assert profile["steps"] == 2 and profile["device_kind"] == "cpu" and profile["device_busy"] is None
    spent = profile["op_s_per_step"]
    assert list(spent) == list(CATEGORY_NAMES)
    # The SD 1.x UNet's work is all there: convolutions, linear layers, attention, group / layer norms, and the
    # full finetune's AdamW step over the whole UNet.
    for category in ("convolution", "matmul", "attention", "normalization", "optimizer"):
        assert spent[category] > 0, category
    assert spent["communication"] == 0  # one process
    # Own (self) times do not nest, so together they fit in the wall time of the profiled steps.
    assert 0.3 * profile["wall_s_per_step"] < sum(spent.values()) <= 1.05 * profile["wall_s_per_step"]
    text = (out / "tiny-sd15-full-32-b2-fp32_profile.md").read_text()
    assert "| convolution |" in text and "aten::" in text  # the category table and torch's top-ops table
    # the copies by input shape: the AdamW step's and the data's copies, each with its shapes
    copies = text.split("Copies and casts by input shape:")[1]
    assert "aten::copy_" in copies and "Input Shapes" in copies and "[[" in copies
    with gzip.open(out / "tiny-sd15-full-32-b2-fp32_trace.json.gz", "rt") as trace:
        names = {event.get("name", "") for event in json.load(trace)["traceEvents"]}
    assert any(name.startswith("aten::convolution") for name in names)


@pytest.mark.parametrize("op, category", [
    ("aten::mm", "matmul"), ("aten::addmm", "matmul"), ("extern_kernels.mm", "matmul"),
    ("aten::cudnn_convolution", "convolution"), ("aten::convolution_backward", "convolution"),
    ("aten::_scaled_dot_product_flash_attention", "attention"),
    ("aten::_efficient_attention_backward", "attention"),
    ("aten::native_group_norm", "normalization"), ("triton_red_fused_native_layer_norm_0", "normalization"),
    ("aten::_foreach_mul_", "optimizer"), ("Optimizer.step#AdamW.step", "optimizer"),
    ("aten::copy_", "copies and casts"), ("aten::to", "copies and casts"), ("Memcpy HtoD", "copies and casts"),
    ("nccl:all_reduce", "communication"), ("c10d::allreduce_", "communication"),
    ("_c10d_functional::all_gather_into_tensor", "communication"), ("c10d::broadcast_", "communication"),
    ("aten::broadcast_tensors", "elementwise and other"),  # a view, no communication
    ("aten::topk", "elementwise and other"),  # not a cast because it starts like aten::to
    ("aten::silu", "elementwise and other"), ("triton_poi_fused_add_mul_0", "elementwise and other"),
])
def test_ops_fall_in_their_category(op, category):
    assert category_of(op) == category


def cpu_op(name, own_device_us, own_cpu_us=5.0):
    return SimpleNamespace(name=name, device_type=DeviceType.CPU, self_device_time_total=own_device_us,
                           self_cpu_time_total=own_cpu_us)


def kernel(name, us):
    return SimpleNamespace(name=name, device_type=DeviceType.CUDA, self_device_time_total=us, self_cpu_time_total=0)


def test_on_a_gpu_each_kernel_counts_once_and_the_idle_time_shows():
    """On CUDA an op's own time is the time of the kernels it launched itself; the kernels are also events of
    their own, which must not be counted a second time, and a kernel no op launched stays in the total."""
    events = [cpu_op("aten::mm", 3000.0), kernel("sm90_gemm", 3000.0),
              cpu_op("aten::add", 1000.0), kernel("vectorized_elementwise_kernel", 1000.0),
              cpu_op("aten::linear", 0.0),  # launches nothing itself: its mm child did
              kernel("ncclDevKernel_AllReduce", 2000.0)]  # on a side stream, no op of this thread launched it
    profile = summarize(events, steps=2, wall_s=0.010, cuda=True, averages=SimpleNamespace(table=lambda **_: ""))
    assert profile.kernel_s_per_step == pytest.approx(0.003)  # (3 + 1 + 2) ms over 2 steps
    assert profile.device_busy == pytest.approx(0.6)  # 3 ms of kernels in 5 ms of wall time per step
    spent = profile.op_s_per_step
    assert spent["matmul"] == pytest.approx(0.0015) and spent["elementwise and other"] == pytest.approx(0.0005)
    assert spent["unattributed kernels"] == pytest.approx(0.001)
    assert sum(spent.values()) == pytest.approx(profile.kernel_s_per_step)
    assert profile.kernels_per_step == pytest.approx(1.5)  # 3 launches over 2 steps: what paces a host-bound step
    assert "device busy 60.0 %" in profile.text("a run") and "2 launches" in profile.text("a run")


def test_a_negative_profile_is_refused(tmp_path, capsys):
    code = main(["bench", "--model", "tiny-sd15", "--device", "cpu", "--out", str(tmp_path), "--profile", "-1"])
    assert code == 2
    assert "--profile: must be at least 0" in capsys.readouterr().err


def averaged(key, shapes, count, own_device_us, own_cpu_us):
    return SimpleNamespace(key=key, input_shapes=shapes, count=count, self_device_time_total=own_device_us,
                           self_cpu_time_total=own_cpu_us)


def test_on_a_gpu_the_copies_by_shape_rank_by_their_device_time():
    """On a GPU the grouped copy ops carry device time while no kernel row is among them: the table that torch's
    EventList would print divides by the kernels' total (zero) and fails; this one ranks by device time per step."""
    by_shape = [averaged("aten::mm", [[8, 8], [8, 8]], 4, 9000.0, 40.0),
                averaged("aten::copy_", [[4096, 3072], [4096, 3072], []], 6, 3000.0, 60.0),
                averaged("aten::_to_copy", [[320, 320]], 200, 5000.0, 900.0)]
    events = [cpu_op("aten::copy_", 3000.0), kernel("copy_kernel", 3000.0)]
    profile = summarize(events, steps=2, wall_s=0.010, cuda=True, averages=SimpleNamespace(table=lambda **_: ""),
                        by_shape=by_shape)
    rows = [line for line in profile.top_copies.splitlines() if line.startswith("| aten::")]
    assert rows == ["| aten::_to_copy | [[320, 320]] | 100 | 2.500 |",
                    "| aten::copy_ | [[4096, 3072], [4096, 3072], []] | 3 | 1.500 |"]  # no matmul: copies only
    assert "own device ms per step" in profile.text("a run")
