"""Helpers shared by the benchmark scripts (run them as `python perf/<script>.py`)."""

from __future__ import annotations

import platform


def cpu_name() -> str:
    """The CPU model as /proc/cpuinfo names it (the machine a figure was measured on)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni",
          "avx512_fp16", "amx_bf16", "amx_int8", "amx_tile")


def cpu_flags() -> str:
    """The vector extensions of /proc/cpuinfo's flags that decide which kernels can run."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    have = set(line.split(":", 1)[1].split())
                    return " ".join(x for x in _FLAGS if x in have) or "none of " + ", ".join(_FLAGS)
    except OSError:
        pass
    return "unknown"


def add_model_dims_args(ap, *, layers_default: int = 28) -> None:
    """The Qwen3-0.6B model dimensions (the defaults) as CLI options."""
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--h-q", type=int, default=16)
    ap.add_argument("--h-kv", type=int, default=8)
    ap.add_argument("--d-head", type=int, default=128)
    ap.add_argument("--d-ff", type=int, default=3072)
    ap.add_argument("--layers", type=int, default=layers_default)
    ap.add_argument("--vocab", type=int, default=151936)


def add_model_shape_args(ap, *, new_default: int, reps_default: int) -> None:
    """The Qwen3-0.6B decode shape (the defaults) and the run lengths, as CLI options."""
    add_model_dims_args(ap)
    ap.add_argument("--prompt", type=int, default=8, help="prompt tokens")
    ap.add_argument("--new", type=int, default=new_default, help="new tokens per timed run")
    ap.add_argument("--reps", type=int, default=reps_default)
