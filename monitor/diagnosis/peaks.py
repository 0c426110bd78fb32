"""Peak dense FLOP/s of common GPUs by dtype: the denominator of MFU.

NVIDIA's datasheet figures without sparsity (the sheets print tensor-core figures "with
sparsity", twice these), as Lightning's ThroughputMonitor and torchtitan use them. TF32 is what
float32 matmuls get when torch.get_float32_matmul_precision() is not "highest". A device not
listed has no MFU unless the run names its peak (TORCHTOP_PEAK_TFLOPS or
`torchtop.agent.start(peak_tflops=...)`); so does any device whose clocks or power limits differ
from the sheet's.
"""

from __future__ import annotations

# (name, the words the CUDA device name must hold, TFLOP/s by dtype); first match wins
PEAKS: tuple[tuple[str, tuple[str, ...], dict[str, float]], ...] = (
    (
        "H100 NVL",
        ("h100", "nvl"),
        {"fp64": 30.0, "fp32": 60.0, "tf32": 417.5, "bf16": 835.0, "fp16": 835.0, "fp8": 1670.0},
    ),
    (
        "H100 PCIe",
        ("h100", "pcie"),
        {"fp64": 25.6, "fp32": 51.2, "tf32": 378.0, "bf16": 756.5, "fp16": 756.5, "fp8": 1513.0},
    ),
    (
        "H200 NVL",
        ("h200", "nvl"),
        {"fp64": 30.0, "fp32": 60.0, "tf32": 417.5, "bf16": 835.0, "fp16": 835.0, "fp8": 1670.0},
    ),
    (
        "H100 SXM",
        ("h100",),
        {"fp64": 33.5, "fp32": 66.9, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4, "fp8": 1978.9},
    ),
    (
        "H200",
        ("h200",),
        {"fp64": 33.5, "fp32": 66.9, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4, "fp8": 1978.9},
    ),
    (
        "GH200",
        ("gh200",),
        {"fp64": 33.5, "fp32": 66.9, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4, "fp8": 1978.9},
    ),
    (
        "B200",
        ("b200",),
        {"fp64": 37.0, "fp32": 75.0, "tf32": 1100.0, "bf16": 2250.0, "fp16": 2250.0, "fp8": 4500.0},
    ),
    ("A100", ("a100",), {"fp64": 9.7, "fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0}),
    ("A10G", ("a10g",), {"fp32": 31.2, "tf32": 35.0, "bf16": 70.0, "fp16": 70.0}),
    ("A10", ("a10",), {"fp32": 31.2, "tf32": 62.5, "bf16": 125.0, "fp16": 125.0}),
    ("L40S", ("l40s",), {"fp32": 91.6, "tf32": 183.0, "bf16": 362.1, "fp16": 362.1, "fp8": 733.0}),
    ("L40", ("l40",), {"fp32": 90.5, "tf32": 90.5, "bf16": 181.0, "fp16": 181.0, "fp8": 362.0}),
    ("L4", ("l4",), {"fp32": 30.3, "tf32": 60.0, "bf16": 121.0, "fp16": 121.0, "fp8": 242.0}),
    ("RTX 4090", ("4090",), {"fp32": 82.6, "tf32": 82.6, "bf16": 165.2, "fp16": 165.2}),
    ("RTX 3090", ("3090",), {"fp32": 35.6, "tf32": 35.6, "bf16": 71.0, "fp16": 71.0}),
    ("V100", ("v100",), {"fp64": 7.8, "fp32": 15.7, "fp16": 125.0}),
    ("T4", ("t4",), {"fp32": 8.1, "fp16": 65.0}),
)

_DTYPES = {
    "bfloat16": "bf16",
    "float16": "fp16",
    "float32": "fp32",
    "float64": "fp64",
    "float8_e4m3fn": "fp8",
    "float8_e5m2": "fp8",
    "float8_e4m3fnuz": "fp8",
    "float8_e5m2fnuz": "fp8",
}


def precision(dtype: str, tf32: bool) -> str:
    """A torch dtype name ("bfloat16") as the table's column ("bf16"); float32 with TF32 on: "tf32"."""
    p = _DTYPES.get(dtype.replace("torch.", ""), dtype)
    return "tf32" if p == "fp32" and tf32 else p


def _words(name: str) -> list[str]:
    return name.lower().replace("-", " ").replace("_", " ").split()


def lookup(device_name: str, prec: str) -> tuple[str, float] | None:
    """(the table's name for the device, its peak TFLOP/s at `prec`), or None."""
    words = _words(device_name)
    for label, needles, peaks in PEAKS:
        if all(any(w == n or w.startswith(n) and not w[len(n) :].isalpha() for w in words) for n in needles):
            return (label, peaks[prec]) if prec in peaks else None
    return None
