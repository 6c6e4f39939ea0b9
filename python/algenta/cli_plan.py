"""``algenta plan``: what a resident decode session (and a chunked training loss) would cost.

Every number comes from :mod:`algenta.residentk.contract`, :mod:`algenta.residentk.probe` and
:mod:`algenta.lossk`; this module only resolves the model shape, parses sizes and lays out the
report (an aligned table, or one JSON object with ``--json``).
"""

from __future__ import annotations

import argparse
import json
import re
import sys

from .cli import CliError
from .residentk.config import SHAPE_KEYS

_DIM_NAMES = SHAPE_KEYS
_HF_KEYS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "intermediate_size", "num_hidden_layers", "vocab_size")

_EPILOG = """\
model shape (exactly one):
  MODEL                 a preset (algenta plan --list): {presets}
  --config PATH         a HuggingFace config.json (or the directory holding it), or a .gguf file
  --dims D,HQ,HKV,DH,FF,L,V
                        d_model, query heads, key/value heads, head_dim, d_ff, layers, vocab

sizes: --gpu-mem takes 80GiB, 81920MiB, 80G (binary), 80GB (10^9 bytes) or a bare number of GiB.
--weights says how the weight matrices (q, k, v, o, gate, up, down, embedding, lm_head) are held:
f32 (4 bytes an element, the default), bf16 or f16 (2), int8 (1, plus one float32 scale per
block of 32 along each row). --kv says how the KV cache holds keys and values: f32 (the
default), bf16 or f16 (2 bytes). The norms are float32 in every format; element counts do not
change, bytes do. A session allocates its KV cache at the bucketed capacity (the next power of
two from 512 to 65,536), so that, with the weights in the --weights format and the cache in the
--kv format, is what --gpu-mem is checked against. --slots N sizes serving N sequences of --ctx
positions from one session (algenta serve --slots): the weights once, one bucketed KV cache per
sequence, checked against --mem (host memory, the CPU engine) or --gpu-mem, with the most
sequences that fit.

exit status: 0 the shape is supported (and fits --gpu-mem, and --slots fits), 1 it is refused
or does not fit, 2 bad input.

examples:
  algenta plan qwen3-0.6b
  algenta plan qwen3-8b --ctx 8192 --gpu-mem 80GiB --tp 2
  algenta plan qwen3-8b --weights int8 --gpu-mem 24GiB
  algenta plan qwen3-8b --ctx 32768 --weights bf16 --kv bf16 --gpu-mem 24GiB
  algenta plan qwen3-0.6b --slots 16 --ctx 4096 --weights int8 --kv bf16 --mem 16GiB
  algenta plan --config ./Qwen3-4B/config.json --train-tokens 2048 --chunk 256 --json
"""


# ---- argument parsing ------------------------------------------------------------------------

def _int(text: str, name: str, *, minimum: int = 1) -> int:
    """An integer >= minimum; the error names ``name`` unless it is empty (argparse already
    names the option in its own message)."""
    who = f"{name} " if name else ""
    t = str(text).strip().replace("_", "")
    if not re.fullmatch(r"[+-]?\d+", t):
        raise argparse.ArgumentTypeError(f"{who}must be an integer, got {text!r}")
    v = int(t)
    if v < minimum:
        raise argparse.ArgumentTypeError(f"{who}must be >= {minimum}, got {v}")
    if v >= 2**63:
        raise argparse.ArgumentTypeError(f"{who}must be below 2**63, got {v}")
    return v


def _arg_int(name: str, minimum: int = 1):
    def parse(text):
        return _int(text, "", minimum=minimum)

    parse.__name__ = name  # argparse names the type in its messages
    return parse


_UNITS = {"": 2**30, "b": 1, "k": 2**10, "kib": 2**10, "kb": 10**3, "m": 2**20, "mib": 2**20,
          "mb": 10**6, "g": 2**30, "gib": 2**30, "gb": 10**9, "t": 2**40, "tib": 2**40,
          "tb": 10**12}


def parse_size(text: str) -> int:
    """Bytes in a size such as ``80GiB``, ``81920MiB``, ``80G`` (binary), ``80GB`` (SI) or
    ``80`` (GiB)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(text))
    unit = m.group(2).lower() if m else None
    if not m or unit not in _UNITS:
        raise argparse.ArgumentTypeError(
            f"must be a size such as 80GiB, 81920MiB or 80GB, got {text!r}")
    value = float(m.group(1)) * _UNITS[unit]
    if not 1 <= value < 2**62:
        raise argparse.ArgumentTypeError(f"{text!r} is out of range (1 byte to 4 EiB)")
    return int(value)


def _parse_dims(text: str) -> list:
    parts = [p.strip() for p in str(text).split(",")]
    if len(parts) != 7:
        raise CliError(f"--dims needs 7 comma-separated integers ({','.join(_DIM_NAMES)}), "
                       f"got {len(parts)}")
    try:
        return [_int(p, n) for p, n in zip(parts, _DIM_NAMES)]
    except argparse.ArgumentTypeError as e:
        raise CliError(f"--dims: {e}") from None


def resolve_shape(args):
    """The ModelShape and a description of where it came from."""
    from .residentk import presets

    given = [x for x in (args.model, args.config, args.dims) if x is not None]
    if len(given) != 1:
        raise CliError("give exactly one model shape: a preset name, --config PATH or --dims "
                       f"LIST (presets: {', '.join(presets.PRESETS)})")
    if args.model is not None:
        try:
            shape, source = presets.preset(args.model), f"preset {args.model.lower()}"
        except KeyError as e:
            raise CliError(e.args[0]) from None
    elif args.config is not None:
        try:
            shape = presets.load_hf_config(args.config)
        except ValueError as e:
            raise CliError(f"{args.config}: {e}") from None
        source = f"config {args.config}"
        for n, key in zip(_DIM_NAMES, _HF_KEYS):
            if shape[n] < 1:
                raise CliError(f"{args.config}: {key} must be >= 1, got {shape[n]}")
    else:
        v = _parse_dims(args.dims)
        shape = presets.ModelShape(name="custom", **dict(zip(_DIM_NAMES, v)), tied=True,
                                   rope_theta=1000000.0, rms_eps=1e-6, family={})
        source = "--dims"
    if args.untied and shape.tied:
        shape = presets.ModelShape(**{**dict(shape), "tied": False})
    return shape, source


# ---- the plan --------------------------------------------------------------------------------

_TERMS = ("attn", "mlp", "norms", "embed", "lm_head")


def _term_bytes(fp: dict, dims, tied: bool, tp: int, fmt: str, family=None) -> dict:
    """Bytes of each weight term of the footprint ``fp`` (per GPU at ``tp``) with the matrices in
    ``fmt``: every matrix through :func:`residentk_matrix_bytes` (int8's scales depend on each
    matrix's row length), the norms in float32. The table's per-term rows; the contract itself
    reports only the sum, ``weight_bytes``, which these are checked against."""
    from .residentk import contract as rc

    if fp["status"] != rc.RESIDENT_OK:
        return dict.fromkeys(_TERMS, 0)
    d, hq, hkv, dh, ff, n_layers, vocab = dims
    hq, hkv, ff = hq // tp, hkv // tp, ff // tp

    def mb(rows, cols):  # a (rows, cols) weight: rows outputs, cols inputs (its row length)
        return rc.residentk_matrix_bytes(rows, cols, fmt)

    extra = {"attn": 0, "mlp": 0}  # a family's biases, float32 (weights.family_vector_elems)
    if family:
        from .residentk.weights import family_vector_elems

        extra = family_vector_elems(dict(zip(_DIM_NAMES, dims), tie_word_embeddings=tied,
                                         family=family), tp)
    out = {"attn": n_layers * (mb(hq * dh, d) + 2 * mb(hkv * dh, d) + mb(d, hq * dh))  # q k v o
           + 4 * extra["attn"],
           "mlp": n_layers * (2 * mb(ff, d) + mb(d, ff)) + 4 * extra["mlp"],          # gate up down
           "norms": 4 * fp["norms"],
           "embed": mb(vocab, d),
           "lm_head": 0 if tied else mb(vocab, d)}
    if sum(out.values()) != fp["weight_bytes"]:  # the two descriptions of the weights disagree
        raise RuntimeError(f"per-term weight bytes {sum(out.values()):,} != the contract's "
                           f"weight_bytes {fp['weight_bytes']:,} ({fmt})")
    return out


def _bytes(at_ctx: dict, at_bucket: dict, terms: dict) -> dict:
    """The ``bytes`` object of the report: sizes with the weights and the KV cache in the
    report's formats."""
    return {"weight_terms": terms, "weights": at_ctx["weight_bytes"],
            "kv_cache": at_ctx["kv_bytes"], "total": at_ctx["total_bytes"],
            "kv_cache_bucket": at_bucket["kv_bytes"], "total_bucket": at_bucket["total_bytes"]}


def _footprint(rc, shape, *args, **kw):
    """residentk_footprint of the shape's family (its biases and extra norms counted)."""
    return rc.residentk_footprint(*args, family=shape.family, **kw)


def plan(shape, *, ctx: int = 512, tp: int = 1, gpu_mem=None, train_tokens=None, chunk=None,
         weights: str = "f32", kv: str = "f32", slots=None, mem=None) -> dict:
    """The report as one JSON-ready dict (what ``--json`` prints). ``weights`` is the weight
    format (``f32``, ``bf16``, ``f16``, ``int8``) and ``kv`` the KV cache's (``f32``, ``bf16``,
    ``f16``): they change the ``bytes`` object, the ``tp`` share's ``bytes`` and the ``gpu``
    answers; every ``*_elems`` key and ``resident_bytes`` / ``resident_bucket_bytes`` (float32
    bytes) mean the same in every format."""
    from . import _core
    from .lossk import contract as lc
    from .lossk import cross_entropy as lce
    from .residentk import contract as rc
    from .residentk import probe as rp

    dims = [shape[n] for n in _DIM_NAMES]
    if not 1 <= ctx <= rc.RESIDENT_MAX_CONTEXT:
        raise CliError(f"--ctx must be between 1 and {rc.RESIDENT_MAX_CONTEXT:,} "
                       f"(RESIDENT_MAX_CONTEXT), got {ctx:,}")
    status, reason = rc.residentk_shape_reason(*dims)
    # A shape refused only for the shared-memory tier is still sized: the sizes are what a
    # rebuild with a larger ALGENTA_SMEM_TIER_BYTES would hold.
    sized = _footprint(rc, shape, *dims, ctx, tied=shape.tied, check_tier=False, format=weights,
                                   kv_format=kv)
    tier_only = status != rc.RESIDENT_OK and sized["status"] == rc.RESIDENT_OK
    if status != rc.RESIDENT_OK and not tier_only:
        sized = _footprint(rc, shape, *dims, ctx, tied=shape.tied, format=weights,
                                       kv_format=kv)  # all zero
    bucket = rc.resident_bucket_ctx(ctx)
    at_bucket = _footprint(rc, shape, *dims, bucket, tied=shape.tied, check_tier=not tier_only,
                                       format=weights, kv_format=kv)
    probe = rp.resident_session_probe(*dims)

    out = {
        "model": shape.name,
        "shape": {**{n: shape[n] for n in _DIM_NAMES}, "tied": shape.tied,
                  "rope_theta": shape.rope_theta, "rms_eps": shape.rms_eps,
                  "family": dict(shape.family)},
        "status": status,
        "status_name": rc.residentk_status_name(status),
        "reason": reason,
        "smem_tier_bytes": rc.residentk_smem_tier_bytes(),
        "sized_beyond_tier": tier_only,
        # the family's own stage list: the seed's residentk_dispatch_budget for Qwen3
        "dispatch_budget": _core.session.decode_stages(shape.n_layers, dict(shape.family)),
        "dispatch_budget_deep": rc.residentk_dispatch_budget_deep(shape.n_layers),
        "ctx": ctx,
        "ctx_bucket": bucket,
        "weights_f32_elems": sized["weights"],
        "weight_terms": {k: sized[k] for k in ("attn", "mlp", "norms", "embed", "lm_head")},
        "kv_cache_elems": sized["kv_cache"],
        "kv_cache_bucket_elems": at_bucket["kv_cache"],
        "resident_f32_elems": sized["total"],
        "resident_bytes": 4 * sized["total"],
        "resident_bucket_bytes": 4 * at_bucket["total"],
        "weight_format": weights,
        "kv_format": kv,
        "bytes": _bytes(sized, at_bucket,
                        _term_bytes(sized, dims, shape.tied, 1, weights, shape.family)),
        "build": {"kernels_compiled": probe.kernels_compiled,
                  "device_present": probe.device_present,
                  "probe_status": probe.status,
                  "probe_status_name": rc.residentk_status_name(probe.status)},
    }
    per_gpu = at_bucket
    if tp != 1:
        share = _footprint(rc, shape, *dims, ctx, tied=shape.tied, tp=tp, check_tier=not tier_only,
                                       format=weights, kv_format=kv)
        if share["status"] == rc.RESIDENT_ERR_HEAD_GEOMETRY and sized["status"] == rc.RESIDENT_OK:
            raise CliError(f"--tp {tp} must divide h_q {shape.h_q}, h_kv {shape.h_kv} and d_ff "
                           f"{shape.d_ff} (the heads and the MLP are split {tp} ways)")
        per_gpu = _footprint(rc, shape, *dims, bucket, tied=shape.tied, tp=tp,
                                         check_tier=not tier_only, format=weights,
                                         kv_format=kv)
        out["tp"] = {"n": tp, "weight_terms": {k: share[k] for k in ("attn", "mlp", "norms",
                                                                      "embed", "lm_head")},
                     "weights_f32_elems": share["weights"],
                     "kv_cache_elems": share["kv_cache"], "resident_f32_elems": share["total"],
                     "resident_bytes": 4 * share["total"],
                     "kv_cache_bucket_elems": per_gpu["kv_cache"],
                     "resident_bucket_bytes": 4 * per_gpu["total"],
                     "bytes": _bytes(share, per_gpu,
                                     _term_bytes(share, dims, shape.tied, tp, weights,
                                                 shape.family))}
    if gpu_mem is not None:
        need = per_gpu["total_bytes"]  # per GPU, at the bucket, weights in the format
        ok = status == rc.RESIDENT_OK or tier_only
        out["gpu"] = {
            "budget_bytes": gpu_mem,
            "need_bytes": need,
            "fits": bool(ok and need <= gpu_mem),
            "headroom_bytes": gpu_mem - need if ok else None,
            "max_ctx": rc.residentk_max_ctx_fitting(*dims, gpu_mem, tied=shape.tied, tp=tp,
                                                    check_tier=not tier_only, format=weights,
                                                    kv_format=kv),
        }
    if slots is not None:
        # Serving: the weights once and one KV cache per sequence, each at the bucket a
        # session allocates; against --mem (host memory, the CPU engine) or --gpu-mem.
        if not 1 <= slots <= rc.RESIDENT_MAX_SLOTS:
            raise CliError(f"--slots must be between 1 and {rc.RESIDENT_MAX_SLOTS:,} "
                           f"(RESIDENT_MAX_SLOTS), got {slots:,}")
        budget = mem if mem is not None else gpu_mem
        ok = status == rc.RESIDENT_OK or tier_only
        need = per_gpu["weight_bytes"] + slots * per_gpu["kv_bytes"]
        out["slots"] = {
            "n": slots, "ctx": ctx, "ctx_bucket": bucket,
            "weight_bytes": per_gpu["weight_bytes"], "kv_bytes_per_slot": per_gpu["kv_bytes"],
            "need_bytes": need if ok else 0,
            "budget_bytes": budget,
            "budget_of": None if budget is None else ("host" if mem is not None else "gpu"),
            "fits": None if budget is None else bool(ok and need <= budget),
            "max_slots": None if budget is None else rc.residentk_slots_fitting(
                *dims, ctx, budget, tied=shape.tied, tp=tp, check_tier=not tier_only,
                format=weights, kv_format=kv),
        }
    if train_tokens is not None:
        max_chunk = lc.loss_max_chunk(train_tokens, shape.vocab)
        c = chunk if chunk is not None else max(max_chunk, 1)
        rec = lce.ce_peak_logit_cells(train_tokens, shape.vocab, c)
        out["loss"] = {"n_tok": train_tokens, "vocab": shape.vocab, "chunk": c, **dict(rec),
                       "status_name": lc.loss_status_name(rec["status"]),
                       "max_chunk": max_chunk}
    return out


def exit_status(report: dict) -> int:
    if report["status"] != 600:
        return 1
    if "gpu" in report and not report["gpu"]["fits"]:
        return 1
    if report.get("slots", {}).get("fits") is False:
        return 1
    return 0


# ---- human output ----------------------------------------------------------------------------

def _n(v) -> str:
    return f"{v:,}"


def _gib(nbytes) -> str:
    return f"{nbytes / 2**30:,.2f} GiB"


def _table(rows, align: str, indent: str = "  ") -> list:
    """Rows of cells -> aligned lines; ``align`` has one letter per column, ``l`` or ``r``. A
    row that is a plain string is a heading, printed as is."""
    cells = [r for r in rows if not isinstance(r, str)]
    ncol = max(map(len, cells))
    width = [max((len(r[i]) for r in cells if i < len(r)), default=0) for i in range(ncol)]
    lines = []
    for r in rows:
        if isinstance(r, str):
            lines.append(r)
            continue
        parts = [c.ljust(width[i]) if align[i] == "l" else c.rjust(width[i])
                 for i, c in enumerate(r)]
        lines.append((indent + "   ".join(parts)).rstrip())
    return lines


def render(report: dict, source: str) -> str:
    s = report["shape"]
    ok = report["status"] == 600
    tier_only = report["sized_beyond_tier"]
    lines = [
        f"{report['model']}  ({source})",
        f"  d_model {_n(s['d_model'])} · heads {s['h_q']} q / {s['h_kv']} kv · head_dim "
        f"{s['d_head']} · d_ff {_n(s['d_ff'])} · layers {s['n_layers']} · vocab {_n(s['vocab'])} · "
        f"{'tied' if s['tied'] else 'separate'} lm_head",
        "",
    ]
    verdict = f"{report['status']} {report['status_name']}"
    verdict += ": a resident session can hold this shape" if ok else f": {report['reason']}"
    b = report["build"]
    build = f"{b['probe_status']} {b['probe_status_name']}"
    if b["probe_status"] == 604:
        build += " (built without ALGENTA_GPU: sizing only)"
    elif b["probe_status"] == 605:
        build += " (CUDA kernels compiled, no usable GPU on this host)"
    elif b["probe_status"] == 600:
        build += " (a session can run on this host)"
    else:
        build += " (the shape is refused before any device question)"
    lines += _table([("shape verdict", verdict), ("this build/host", build)], "ll", indent="")
    if tier_only:
        lines.append(f"  sizes below assume a build with a shared-memory tier large enough "
                     f"(this one has {_n(report['smem_tier_bytes'])} bytes)")
    if not ok and not tier_only:
        return "\n".join(lines) + "\n"

    L = s["n_layers"]
    lines += [""] + _table([
        "dispatches per decode token",
        ("standard", f"{report['dispatch_budget']:,}",
         f"{L} layers x {(report['dispatch_budget'] - 3) // L} + 3"),
        ("split-K attention", f"{report['dispatch_budget_deep']:,}", f"1 + {L} layers x 7 + 2"),
    ], "lrl")

    tp = report.get("tp")
    ctx, bucket = report["ctx"], report["ctx_bucket"]
    fmt, kvf = report["weight_format"], report["kv_format"]
    formats = ", ".join(([f"{fmt} weights"] if fmt != "f32" else []) +
                        ([f"{kvf} KV cache"] if kvf != "f32" else []))  # "" when all float32
    full = {**report["weight_terms"], "weights": report["weights_f32_elems"],
            "kv": report["kv_cache_elems"], "total": report["resident_f32_elems"],
            "kv_bucket": report["kv_cache_bucket_elems"],
            "total_bucket": report["resident_bucket_bytes"] // 4}

    def in_format(b):  # the bytes object, keyed like the rows below
        return {**b["weight_terms"], "weights": b["weights"], "kv": b["kv_cache"],
                "total": b["total"], "kv_bucket": b["kv_cache_bucket"],
                "total_bucket": b["total_bucket"]}

    nbytes = in_format(report["bytes"])
    share = tp and in_format(tp["bytes"])
    rows = [("  attention (q, k, v, o)", "attn"), ("  MLP (gate, up, down)", "mlp"),
            ("  norms", "norms"),
            ("  embedding" + (" (tied to lm_head)" if s["tied"] else ""), "embed")]
    if not s["tied"]:
        rows.append(("  lm_head", "lm_head"))
    rows += [("weights", "weights"), (f"KV cache at ctx {ctx:,}", "kv"), ("total", "total")]
    if bucket != ctx:
        rows += [(f"KV cache at bucket {bucket:,}", "kv_bucket"),
                 (f"total at bucket {bucket:,}", "total_bucket")]
    head = f"resident, {formats}" if formats else "resident float32"
    table = [(head, "elements", "bytes", "size")
             + ((f"per GPU (tp={tp['n']})",) if tp else ())]
    for label, key in rows:
        r = (label, _n(full[key]), _n(nbytes[key]), _gib(nbytes[key]))
        if tp:
            r += (_gib(share[key]) if key in share else "",)
        table.append(r)
    lines += [""] + _table(table, "lrrrr", indent="")
    if formats:
        what = {"f32": "4 bytes an element", "int8": "1 byte an element + one float32 scale "
                "per 32 along each row"}.get(fmt, "2 bytes an element")
        lines += [f"  {fmt} weight matrices: {what}; {kvf} KV cache: "
                  f"{4 if kvf == 'f32' else 2} bytes an element;",
                  f"  norms stay float32 (all float32 at bucket {bucket:,}: "
                  f"{_gib(report['resident_bucket_bytes'])})"]

    g = report.get("gpu")
    if g:
        where = f"per GPU, tp={tp['n']}" if tp else "one GPU"
        if formats:  # the float32 report reads as it always has
            where += f", {formats}"
        verdict = "fits" if g["fits"] else "does NOT fit"
        head_room = g["headroom_bytes"]
        rows = [
            f"GPU memory {_gib(g['budget_bytes'])} ({_n(g['budget_bytes'])} bytes), {where}",
            (f"session at ctx {ctx:,} (allocates bucket {bucket:,})", _gib(g["need_bytes"]),
             verdict),
            ("headroom" if head_room >= 0 else "short by", _gib(abs(head_room)), ""),
            ("largest context that fits",
             f"{g['max_ctx']:,}" if g["max_ctx"] else "none", "positions" if g["max_ctx"]
             else "(not even 512 positions)"),
        ]
        lines += [""] + _table(rows, "lrl")

    sl = report.get("slots")
    if sl:
        where = {"host": "host memory", "gpu": "GPU memory"}.get(sl["budget_of"])
        rows = [f"serving {sl['n']:,} sequences of {sl['ctx']:,} positions (each allocates "
                f"{sl['ctx_bucket']:,})",
                ("weights, once", _gib(sl["weight_bytes"]), ""),
                ("KV cache per sequence", _gib(sl["kv_bytes_per_slot"]), ""),
                (f"total for {sl['n']:,}", _gib(sl["need_bytes"]),
                 "" if sl["fits"] is None else ("fits" if sl["fits"] else "does NOT fit") +
                 f" in {_gib(sl['budget_bytes'])} of {where}")]
        if sl["max_slots"] is not None:
            rows.append((f"most sequences at ctx {sl['ctx']:,}", f"{sl['max_slots']:,}",
                         "" if sl["max_slots"] else "(the weights and one do not fit)"))
        lines += [""] + _table(rows, "lrl")

    lo = report.get("loss")
    if lo:
        rows = [
            f"training loss: {lo['n_tok']:,} tokens x vocab {lo['vocab']:,}, chunk {lo['chunk']:,}",
            ("logit cells held per chunk", _n(int(lo["chunked_cells"]))
             if lo["chunked_cells"] >= 0 else "-"),
            ("logit cells if materialized", _n(int(lo["materialized_cells"]))
             if lo["materialized_cells"] >= 0 else "-"),
            ("ratio", f"{lo['ratio']:,.2f}x"),
            ("chunks", _n(lo["n_chunks"])),
            ("status", f"{lo['status']} {lo['status_name']}"),
            ("largest chunk the logit budget admits", f"{lo['max_chunk']:,} tokens"),
        ]
        lines += [""] + _table(rows, "lr")
    return "\n".join(lines) + "\n"


# ---- the subcommand --------------------------------------------------------------------------

def list_presets() -> str:
    from .residentk.presets import PRESETS

    rows = [("preset", "d_model", "heads q/kv", "head_dim", "d_ff", "layers", "vocab", "lm_head")]
    for key, m in PRESETS.items():
        rows.append((key, _n(m.d_model), f"{m.h_q}/{m.h_kv}", str(m.d_head), _n(m.d_ff),
                     str(m.n_layers), _n(m.vocab), "tied" if m.tied else "separate"))
    return "\n".join(_table(rows, "lrrrrrrl", indent="")) + "\n"


def run(args) -> int:
    if args.list:
        sys.stdout.write(list_presets())
        return 0
    shape, source = resolve_shape(args)
    if args.chunk is not None and args.train_tokens is None:
        raise CliError("--chunk needs --train-tokens")
    report = plan(shape, ctx=args.ctx, tp=args.tp, gpu_mem=args.gpu_mem,
                  train_tokens=args.train_tokens, chunk=args.chunk, weights=args.weights,
                  kv=args.kv, slots=args.slots, mem=args.mem)
    if args.json:
        json.dump(report, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(render(report, source))
    sys.stdout.flush()
    return exit_status(report)


def register(subparsers) -> None:
    from .residentk.contract import RESIDENT_KV_FORMATS, RESIDENT_WEIGHT_FORMATS
    from .residentk.presets import PRESETS

    p = subparsers.add_parser(
        "plan",
        help="size a resident decode session (and a chunked training loss) for a model",
        description="What a resident GPU decode session would hold and cost for a model shape: "
                    "shape verdict, dispatches per token, resident weights (f32, bf16, f16 or "
                    "int8) and KV cache (f32, bf16 or f16), "
                    "fit in GPU memory, tensor-parallel shares, and the chunked-loss logit budget. "
                    "Pure arithmetic: no GPU needed.",
        epilog=_EPILOG.format(presets=", ".join(PRESETS)),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model", nargs="?", metavar="MODEL", help="a preset name (see below)")
    p.add_argument("--config", metavar="PATH", help="HuggingFace config.json, or a .gguf file")
    p.add_argument("--dims", metavar="D,HQ,HKV,DH,FF,L,V", help="the seven dimensions")
    p.add_argument("--untied", action="store_true",
                   help="count a separate lm_head (--dims assumes a tied one)")
    p.add_argument("--ctx", type=_arg_int("--ctx"), default=512, metavar="N",
                   help="KV positions the session is opened at (default 512)")
    p.add_argument("--gpu-mem", type=parse_size, metavar="SIZE",
                   help="memory per GPU: does it fit, largest context, headroom")
    p.add_argument("--weights", choices=RESIDENT_WEIGHT_FORMATS, default="f32",
                   help="how the weight matrices are held: %(choices)s (default %(default)s); "
                        "norms stay float32")
    p.add_argument("--kv", choices=RESIDENT_KV_FORMATS, default="f32",
                   help="how the KV cache holds keys and values: %(choices)s "
                        "(default %(default)s)")
    p.add_argument("--slots", type=_arg_int("--slots"), metavar="N",
                   help="serving: N sequences of --ctx positions in one session (the weights "
                        "once, a KV cache each); with --mem or --gpu-mem: do they fit, and the "
                        "most that do")
    p.add_argument("--mem", type=parse_size, metavar="SIZE",
                   help="host memory for --slots (the CPU engine; default: --gpu-mem)")
    p.add_argument("--tp", type=_arg_int("--tp"), default=1, metavar="N",
                   help="split the heads and the MLP over N GPUs (N must divide them)")
    p.add_argument("--train-tokens", type=_arg_int("--train-tokens"), metavar="N",
                   help="tokens in one training step: report the chunked loss's logit budget")
    p.add_argument("--chunk", type=_arg_int("--chunk"), metavar="C",
                   help="loss chunk (default: the largest the logit budget admits)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--list", action="store_true", help="list the model presets and exit")
    p.set_defaults(handler=run)
