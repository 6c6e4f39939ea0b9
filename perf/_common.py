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


# d_model, h_q, h_kv, d_head, d_ff, layers, vocab
QWEN3_06B = (1024, 16, 8, 128, 3072, 28, 151936)
SMALL = (512, 8, 4, 64, 1536, 6, 32000)  # the small model of the serving benchmarks


def add_model_dims_args(ap, *, layers_default=None, dims=QWEN3_06B) -> None:
    """Model dimensions as CLI options, defaulting to `dims` (Qwen3-0.6B's), with
    layers_default in place of its layer count when given."""
    d, hq, hkv, dh, ff, layers, vocab = dims
    layers = layers if layers_default is None else layers_default
    ap.add_argument("--d-model", type=int, default=d)
    ap.add_argument("--h-q", type=int, default=hq)
    ap.add_argument("--h-kv", type=int, default=hkv)
    ap.add_argument("--d-head", type=int, default=dh)
    ap.add_argument("--d-ff", type=int, default=ff)
    ap.add_argument("--layers", type=int, default=layers)
    ap.add_argument("--vocab", type=int, default=vocab)


def same_prefix(a, b) -> int:
    """How many leading elements two sequences share (greedy tokens agreeing)."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def add_model_shape_args(ap, *, new_default: int, reps_default: int) -> None:
    """The Qwen3-0.6B decode shape (the defaults) and the run lengths, as CLI options."""
    add_model_dims_args(ap)
    ap.add_argument("--prompt", type=int, default=8, help="prompt tokens")
    ap.add_argument("--new", type=int, default=new_default, help="new tokens per timed run")
    ap.add_argument("--reps", type=int, default=reps_default)
