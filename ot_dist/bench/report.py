"""The bench result as a Markdown table row (printed, appended to bench.md) and as JSON (one file per run)."""

from __future__ import annotations

import json
import re
from pathlib import Path

HEADER = ("| model | method | res | batch | dtype | ckpt | device | img/s | step median (s) | step mean (s) "
          "| peak mem (GiB) | TFLOP/img | MFU | performance |")
RULE = "|" + "---|" * (HEADER.count("|") - 1)


def markdown_row(result: dict) -> str:
    method = result["method"] + (f" r{result['lora_rank']}" if result["lora_rank"] else "")
    mfu = "–" if result["mfu"] is None else f"{100 * result['mfu']:.1f} %"
    tflop = "–" if result["tflops_train_per_image"] is None else f"{result['tflops_train_per_image']:.3g}"
    cells = [result["model"], method, result["resolution"], result["batch_size"], result["dtype"],
             "on" if result["gradient_checkpointing"] else "off", result["device_name"],
             f"{result['images_per_s']:.3g}", f"{result['step_time_median_s']:.4g}",
             f"{result['step_time_mean_s']:.4g}", f"{result['peak_memory_gib']:.2f}", tflop, mfu,
             " ".join(f"{k}={v}" for k, v in chosen_performance(result).items()) or "–"]
    return "| " + " | ".join(str(c) for c in cells) + " |"


def chosen_performance(result: dict) -> dict:
    """The performance options this run set away from their defaults, and a frozen storage other than the compute
    dtype, streamed blocks, the fused back pass, bfloat16 trained weights or offloaded activations (`weight_dtype`,
    `offload_fraction`, `fused_back_pass`, `trained_weight_dtype`, `activation_offloading`)."""
    from ot_dist.config.performance import PerformanceConfig
    from ot_dist.precision import DTYPES

    defaults = PerformanceConfig().model_dump(mode="json")
    chosen = {k: v for k, v in (result.get("performance") or {}).items() if defaults.get(k) != v}
    storage = result.get("weight_dtype")
    if storage and storage not in DTYPES:
        chosen["weight_dtype"] = storage
    if result.get("offload_fraction"):
        chosen["offload_fraction"] = result["offload_fraction"]
    if result.get("fused_back_pass"):
        chosen["fused_back_pass"] = True
    if result.get("trained_weight_dtype", "float32") != "float32":
        chosen["trained_weight_dtype"] = result["trained_weight_dtype"]
    if result.get("activation_offloading"):
        chosen["activation_offloading"] = True
    return chosen


def run_name(result: dict) -> str:
    parts = [result["model"], result["method"], str(result["resolution"]), f"b{result['batch_size']}", result["dtype"]]
    if result["gradient_checkpointing"]:
        parts.append("ckpt")
    parts += [f"{k}-{v}" for k, v in chosen_performance(result).items()]
    return re.sub(r"[^A-Za-z0-9_.-]", "_", "-".join(parts))


def write_report(result: dict, out: str | Path) -> tuple[Path, Path]:
    """`out`/<run>.json, and the row appended to `out`/bench.md (the header written first)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    json_path = out / f"{run_name(result)}.json"
    json_path.write_text(json.dumps(result, indent=2) + "\n")
    table = out / "bench.md"
    if not table.exists():
        table.write_text(f"{HEADER}\n{RULE}\n")
    with table.open("a") as f:
        f.write(markdown_row(result) + "\n")
    return json_path, table
