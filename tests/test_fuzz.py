"""Bounded, deterministic fuzzing of everything that takes sizes, arrays or files from a caller.

Two targets: the flat lossk API (and the raw `_core` bindings underneath it, which must hold
their own line when the Python layer is bypassed) and the checkpoint loader
(`ResidentSession.from_pretrained`) fed mutations of a tiny valid Qwen3 checkpoint kept in
tests/fuzz_corpus/. Every case must end in a result, a status-carrying algenta error or a
TypeError; anything else fails the run:

- a crash (segfault, abort, a sanitizer report) kills the child process, whose last printed
  case names the input;
- a MemoryError means something tried to allocate what it was not asked for: every case here
  holds a few KB of data, and the child runs under RLIMIT_AS with ~1 GiB of headroom, so a
  size taken from a lying header or length shows up instead of being quietly overcommitted;
- a plain ValueError/OverflowError/KeyError... is an unclear refusal.

The cases are generated from fixed seeds (the same inputs every run); ALGENTA_FUZZ_CASES scales
the per-target count for a longer hunt. Under AddressSanitizer (tools/sanitize-test) the address
space cap is skipped (ASan reserves terabytes of shadow memory) and ASan's own checks stand in.
"""

from __future__ import annotations

import json
import math
import os
import random
import struct
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

HERE = Path(__file__).resolve().parent
CORPUS = HERE / "fuzz_corpus"
SEED_CKPT = CORPUS / "tiny_qwen3"
CASES = int(os.environ.get("ALGENTA_FUZZ_CASES", "1000"))
HEADROOM = 1 << 30  # address space the child may grow by after warm-up


def sanitized() -> bool:
    with open("/proc/self/maps") as f:
        return any("libasan" in line or "libtsan" in line for line in f)


# ---- safetensors, byte by byte ------------------------------------------------------------------

def st_split(blob: bytes):
    n = struct.unpack("<Q", blob[:8])[0]
    return json.loads(blob[8:8 + n]), blob[8 + n:]


def st_join(meta, data: bytes, *, raw_header: bytes | None = None, length: int | None = None):
    h = raw_header if raw_header is not None else json.dumps(meta).encode()
    n = len(h) if length is None else length
    return struct.pack("<Q", n % 2**64) + h + data


# ---- mutators ------------------------------------------------------------------------------------

_HOSTILE_INTS = [-(2**63), -(2**31), -1, 0, 1, 2, 3, 7, 2**16 - 1, 2**22, 2**22 + 1, 2**31,
                 2**40, 2**62, 2**63 - 1, 2**63, 2**64, 10**30]
_HOSTILE_VALUES = _HOSTILE_INTS + [None, True, False, 1.5, -0.0, 1e308, "8", "", [], [1], {},
                                   {"a": 1}]


def hostile(rng: random.Random):
    return rng.choice(_HOSTILE_VALUES)


def mutate_safetensors(rng: random.Random, blob: bytes) -> tuple[str, bytes]:
    meta, data = st_split(blob)
    names = [k for k in meta if k != "__metadata__"]
    kind = rng.randrange(12)
    if kind == 0:
        cut = rng.randrange(len(blob))
        return f"truncate@{cut}", blob[:cut]
    if kind == 1:
        n = rng.choice([0, 1, 7, len(blob), len(blob) - 8, 2**32, 10**12, 2**63, 2**64 - 1,
                        len(json.dumps(meta)) + rng.choice([-9, -1, 1, 9])])
        return f"header_len={n}", st_join(meta, data, length=n)
    name = rng.choice(names)
    e = meta[name]
    if kind == 2:
        e["dtype"] = rng.choice(["F64", "I8", "U8", "BOOL", "F8_E4M3", "bf16", "F16", "F32",
                                 "BF16", None, 4, ["F32"]])
        return f"{name}.dtype={e['dtype']!r}", st_join(meta, data)
    if kind == 3:
        shape = list(e["shape"])
        how = rng.randrange(6)
        if how == 0 and shape:
            shape[rng.randrange(len(shape))] = hostile(rng)
        elif how == 1:
            shape = shape[::-1]
        elif how == 2:
            shape = shape + [1]
        elif how == 3:
            shape = [int(np.prod(shape))]
        elif how == 4:
            shape = hostile(rng)
        else:
            shape = [2**40, 2**40] if rng.random() < 0.5 else [0] + shape[1:]
        e["shape"] = shape
        return f"{name}.shape={shape!r}", st_join(meta, data)
    if kind == 4:
        b, t = e["data_offsets"]
        how = rng.randrange(7)
        offs = [[t, b], [b, t + 2], [b - 2, t - 2] if b >= 2 else [b + 2, t + 2],
                [b + len(data), t + len(data)], [hostile(rng), t], [b, hostile(rng)],
                hostile(rng)][how]
        e["data_offsets"] = offs
        return f"{name}.data_offsets={offs!r}", st_join(meta, data)
    if kind == 5:  # two tensors claim the same bytes: legal in the format, must not confuse us
        other = meta[rng.choice(names)]
        e["data_offsets"] = list(other["data_offsets"])
        return f"{name} aliases another tensor", st_join(meta, data)
    if kind == 6:
        del meta[name]
        return f"drop {name}", st_join(meta, data)
    if kind == 7:
        meta[name.replace("weight", "wieght")] = meta.pop(name)
        return f"rename {name}", st_join(meta, data)
    if kind == 8:
        raw = bytearray(json.dumps(meta).encode())
        for _ in range(rng.randint(1, 4)):
            raw[rng.randrange(len(raw))] = rng.randrange(256)
        return "header byte flips", st_join(None, data, raw_header=bytes(raw))
    if kind == 9:
        raw = rng.choice([b"[]", b"null", b'"x"', b"{", b"\xff\xfe{}", b"{}", b'{"a": 1}',
                          json.dumps({name: e}).encode() * 2, b'{"__metadata__": 5}'])
        return f"header={raw[:20]!r}", st_join(None, data, raw_header=raw)
    if kind == 10:  # data bytes: may become NaN/inf (refused, 609) or just other weights
        d = bytearray(data)
        for _ in range(rng.randint(1, 16)):
            d[rng.randrange(len(d))] = rng.choice([0xFF, 0x7F, 0x80, 0x00, rng.randrange(256)])
        return "data byte flips", st_join(meta, bytes(d))
    extra = rng.choice([b"", b"\x00" * 3, b"\x00" * 4096])
    return f"trailing {len(extra)} bytes", st_join(meta, data + extra)


_CFG_KEYS = ["hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
             "intermediate_size", "num_hidden_layers", "vocab_size", "rms_norm_eps", "rope_theta",
             "rope_parameters", "rope_scaling", "tie_word_embeddings", "model_type",
             "architectures", "hidden_act", "use_sliding_window", "attention_bias"]


def mutate_config(rng: random.Random, cfg: dict) -> tuple[str, str]:
    cfg = json.loads(json.dumps(cfg))
    kind = rng.randrange(5)
    key = rng.choice(_CFG_KEYS)
    if kind == 0:
        cfg.pop(key, None)
        desc = f"drop {key}"
    elif kind == 1:
        cfg[key] = hostile(rng)
        desc = f"{key}={cfg[key]!r}"
    elif kind == 2:
        v = rng.choice([float("nan"), float("inf"), -float("inf"), 0.0, -1e-6, 1e-300, 10**400])
        cfg[key] = v
        desc = f"{key}={v!r}"
    elif kind == 3:
        for k in rng.sample(_CFG_KEYS, 3):
            cfg[k] = hostile(rng)
        desc = "three hostile fields: " + json.dumps(cfg, default=str)[:200]
    else:
        return "config.json not JSON", rng.choice(["", "{", "[]", "null", "\ud800", '{"a": NaN'])
    return desc, json.dumps(cfg)


# ---- lossk cases -----------------------------------------------------------------------------------

def _array(rng: random.Random, size: int, *, targets=False, vocab=4):
    size = max(size, 0)
    kind = rng.randrange(16)  # 12..15: the plain, well-formed array
    if targets:
        base = np.array([rng.randrange(max(vocab, 1)) for _ in range(size)], dtype=np.int64)
    else:
        base = np.array([rng.uniform(-3, 3) for _ in range(size)], dtype=np.float64)
    if kind == 0:
        return base.tolist()
    if kind == 1 and size:
        a = base.astype(np.float64)
        a[rng.randrange(size)] = rng.choice([np.nan, np.inf, -np.inf])
        return a
    if kind == 2:
        return base.astype(rng.choice([np.float32, np.float16, np.int32, np.uint64, np.int8]))
    if kind == 3:
        return base.astype(rng.choice([np.bool_, np.complex128, object, "U3", "M8[s]"]))
    if kind == 4:
        return base[: max(size - rng.randint(1, 3), 0)]
    if kind == 5:
        return np.concatenate([base, base])
    if kind == 6:
        return rng.choice([None, "abc", 3, 2.5, {"a": 1}, b"\x00" * 8, iter([1, 2])])
    if kind == 7 and size:
        big = rng.choice([2**63 - 1, -(2**63), 2**64 - 1, 2**70, -1, vocab, -100])
        a = base.tolist()
        a[rng.randrange(size)] = big
        return a
    if kind == 8:
        return np.asfortranarray(np.stack([base, base]))[0]  # strided view
    if kind == 9:
        return [base.tolist()] if size else [[]]
    if kind == 10 and size > 1:
        ragged = [[1.0, 2.0], [3.0]] * (size // 2)
        return ragged
    return base


def _dim(rng: random.Random, good: int):
    r = rng.random()
    if r < 0.7:
        return good
    if r < 0.93:
        return rng.choice([0, -1, 1, good + 1, good - 1, 2**17, 2**22, 2**22 + 1, 2**26,
                           2**26 + 1, 2**31, 2**62, 2**63 - 1, 2**63, 2**64, -(2**63),
                           np.int64(good), np.uint64(good)])
    return rng.choice([True, 2.0, "3", None])


def lossk_case(rng: random.Random):
    from algenta import _core, linear_cross_entropy
    from algenta.lossk import cross_entropy as ce
    from algenta.lossk._args import CrossEntropyOptions

    n, d, v = rng.randint(1, 6), rng.randint(1, 5), rng.choice([1, 2, 3, 5, 257, 300])
    N, D, V = _dim(rng, n), _dim(rng, d), _dim(rng, v)
    h = _array(rng, n * d)
    w = _array(rng, v * d)
    t = _array(rng, n, targets=True, vocab=v)
    chunk = rng.choice([None, None, 1, 2, n, n + 1, 0, -1, 2**26, 2**27 // v + 1, 2**27,
                        2**63 - 1, 2**64, 1.0, True, "1"])
    if rng.random() < 0.03:  # within every ceiling, past the work budget: 584 before any length
        N, D, V = 2**26, 2**17, rng.choice([2, 2**22])
    which = rng.randrange(12)
    desc = f"n={N!r} d={D!r} v={V!r} chunk={chunk!r} h={_short(h)} w={_short(w)} t={_short(t)}"
    if which >= 10:
        return distill_case(rng, which == 10, n, d, v, N, D, V, h, w, t, chunk, desc)
    if which == 0:
        return "fused_linear_ce_flat " + desc, lambda: ce.fused_linear_ce_flat(h, w, t, N, D, V, chunk)
    if which == 1:
        return "fused_linear_ce_bwd_flat " + desc, lambda: ce.fused_linear_ce_bwd_flat(h, w, t, N, D, V, chunk)
    if which == 2:
        z = _array(rng, n * v)
        return "ce_from_logits_flat " + desc, lambda: ce.ce_from_logits_flat(z, t, N, V)
    if which == 3:
        z = _array(rng, n * v)
        scale = rng.choice([1.0, 0.5, float("nan"), float("inf"), 0, True, "1", None])
        return f"ce_grad_logits_flat scale={scale!r} " + desc, lambda: ce.ce_grad_logits_flat(z, t, N, V, scale)
    if which == 4:
        return "ce_chunk_invariance_flat " + desc, lambda: ce.ce_chunk_invariance_flat(h, w, t, N, D, V)
    if which == 5:
        z = _array(rng, n * v)

        def acc():
            a = ce.CEAccumulator(V)
            a.add(z, t)
            return a.mean_loss
        return "CEAccumulator " + desc, acc
    if which == 6:
        return "ce_peak_logit_cells " + desc, lambda: ce.ce_peak_logit_cells(N, V, chunk if chunk is not None else 1)
    if which == 7:
        dt = rng.choice([np.float32, np.float64, np.float16, np.int64])
        H = np.array([rng.uniform(-2, 2) for _ in range(n * d)]).reshape(n, d).astype(dt)
        if rng.random() < 0.2:
            H[rng.randrange(n), 0] = rng.choice([np.nan, np.inf]) if H.dtype.kind == "f" else 0
        if rng.random() < 0.1:
            H = rng.choice([H.T, H[:, :0], H.reshape(-1), H[None], H.tolist()])
        Wm = np.ones((V if type(V) is int and 0 < V < 1000 else v, d), dtype=rng.choice([dt, np.float64]))
        kw = dict(chunk=chunk, reduction=rng.choice(["mean", "sum", "none", "avg", None]),
                  ignore_index=rng.choice([None, -100, 0, 2**63, -(2**64), 1.0]),
                  label_smoothing=rng.choice([0.0, 0.1, 1.0, 1.5, -0.1, float("nan"), "0"]),
                  with_grad=rng.choice([False, True, "hidden", "weight", "both", 1]))
        if rng.random() < 0.2:
            kw["grad_output"] = rng.choice([np.ones(n), np.ones(n + 1), [np.nan] * n, "x"])
        return f"linear_cross_entropy H={_short(H)} W={_short(Wm)} {kw!r} " + desc, \
            lambda: linear_cross_entropy(H, Wm, t, **kw)
    # The raw bindings, past every Python-side check: lying dims against real buffers.
    fn = _core.lossk.fused_linear_ce
    elem = rng.choice(["f64", "f32", "f16", "bf16"])
    red = rng.choice(["mean", "sum", "none", "bogus"])
    go = rng.choice([None, np.ones(max(n - 1, 0)), np.ones(n)])
    flags = [rng.random() < 0.5 for _ in range(3)]
    ign = rng.choice([False, True])
    ls = rng.choice([0.0, 0.2, 2.0, float("nan")])
    cap = rng.choice([None, 0.0, -1.0, 30.0, float("inf")])
    zl = rng.choice([0.0, 1e-4, -1.0, float("nan")])
    shift, seq = rng.choice([(0, 0), (1, 2), (1, 1), (3, 2), (-1, 0)])
    if elem in ("f16", "bf16"):  # half inputs arrive as 2-byte bit patterns (or, lying, do not)
        def bits(a):
            ok = isinstance(a, np.ndarray) and a.dtype.kind == "f" and rng.random() < 0.8
            return a.astype(np.float16).view(np.uint16) if ok else a
        h, w = bits(h), bits(w)
    # the options record as the Python layer would never build it (no conversion, no checks)
    opts = CrossEntropyOptions(reduction=red, ignore_index=-100 if ign else None,
                               label_smoothing=ls, softcap=cap, lse_square_scale=zl, shift=shift,
                               chunk=chunk)
    kw = dict(elem=elem, seq_len=seq, want_dh=flags[0], want_dw=flags[1], grad_output=go,
              want_loss_tok=flags[2])
    return (f"_core fused_linear_ce {opts!r} {kw!r} go={_short(go)} " + desc,
            lambda: fn(opts, hidden=h, weight=w, targets=t, n_tok=N, d_model=D, vocab=V, **kw))


def distill_case(rng, numpy_api, n, d, v, N, D, V, h, w, t, chunk, desc):
    """Distillation: the NumPy API with hostile options and heads, or its raw binding with lying
    dims, dtypes and the vocab-parallel form's per-token arrays."""
    from algenta import _core, linear_distillation

    dt_ = rng.randint(1, 4)
    th = _array(rng, n * dt_)
    tw = _array(rng, v * dt_)
    if numpy_api:
        dtype = rng.choice([np.float32, np.float64, np.float16])
        S = np.array([rng.uniform(-2, 2) for _ in range(n * d)]).reshape(n, d).astype(dtype)
        SW = np.ones((v, d), dtype=rng.choice([dtype, np.float64]))
        TI = rng.choice([np.ones((n, dt_), dtype), np.ones((n + 1, dt_), dtype), S, th])
        TW = rng.choice([np.ones((v, dt_), dtype), np.ones((v + 1, dt_), dtype), SW, tw])
        kw = dict(objective=rng.choice(["kl", "reverse_kl", "jsd", "js", None, 3]),
                  beta=rng.choice([0.0, 0.5, 1.0, 1.5, -0.1, float("nan"), "0.5"]),
                  temperature=rng.choice([1.0, 0.5, 0.0, -1.0, float("inf"), 1e-300, "1"]),
                  hard_weight=rng.choice([0.0, 0.5, -1.0, float("nan")]),
                  soft_weight=rng.choice([1.0, 0.0, float("inf")]),
                  ignore_index=rng.choice([-100, None, 2**64]),
                  reduction=rng.choice(["mean", "sum", "none", "avg"]), chunk=chunk,
                  with_grad=rng.choice([False, True, "hidden", "teacher"]))
        target = rng.choice([None, t, np.zeros(n + 1, np.int64)])
        return (f"linear_distillation S={_short(S)} TI={_short(TI)} TW={_short(TW)} {kw!r} "
                + desc, lambda: linear_distillation(S, SW, TI, TW, target, **kw))
    Dt = _dim(rng, dt_)
    k = dict(hidden=h, weight=w, t_hidden=th, t_weight=tw,
             targets=rng.choice([None, t, np.zeros(max(n - 1, 0), np.int64)]),
             elem=rng.choice(["f64", "f32", "bf16", "i8"]),
             t_elem=rng.choice(["f64", "f32", "f16"]), grad_elem=rng.choice(["", "f32", "f16"]),
             n_tok=N, d_model=D, t_d_model=Dt, vocab=V,
             want_dh=rng.random() < 0.5, want_dw=rng.random() < 0.5, want_db=False,
             grad_output=rng.choice([None, np.ones(n), np.ones(max(n - 1, 0))]),
             shard=rng.random() < 0.3,
             shard_lse=rng.choice([None, np.zeros((n, 3)), np.zeros(n)]),
             shard_h=rng.choice([None, np.zeros(n)]),
             shard_coef=rng.choice([None, np.zeros((n, 2)), np.full((n, 2), np.nan)]),
             want_shard_stats=rng.random() < 0.3)
    # the options record, a plain namespace of fields (the binding reads them by name)
    fields = dict(chunk=chunk, objective=rng.choice(["kl", "jsd", "bogus"]),
                  beta=rng.choice([0.5, 2.0]), temperature=rng.choice([1.0, 0.0]),
                  hard_weight=rng.choice([0.0, 1.0]), soft_weight=1.0,
                  reduction=rng.choice(["mean", "none", "bogus"]),
                  ignore_index=rng.choice([None, -100]), grad_scale=1.0)
    if rng.random() < 0.1:  # a missing argument or field: a TypeError naming it
        gone = rng.choice(sorted(k) + sorted(fields))
        k.pop(gone, None)
        fields.pop(gone, None)
    opts = types.SimpleNamespace(**fields)
    shown = {key: (_short(val) if isinstance(val, np.ndarray) else val) for key, val in k.items()}
    return (f"_core fused_linear_distill {opts!r} {shown!r} " + desc,
            lambda: _core.lossk.fused_linear_distill(opts, **k))


def _short(x):
    if isinstance(x, np.ndarray):
        return f"ndarray{x.shape}{x.dtype}"
    if isinstance(x, list):
        return f"list[{len(x)}]"
    return repr(x)[:30]


# ---- the child --------------------------------------------------------------------------------

def _limit_address_space():
    import resource

    with open("/proc/self/status") as f:
        vm = next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (vm + HEADROOM, vm + HEADROOM))
    return vm + HEADROOM


def _warm_up():
    # The OpenMP pool and its per-thread arenas are created by the first parallel call: let them
    # exist before the cap, so the cap measures the cases and not the runtime's start-up.
    import algenta

    h = np.ones((300, 8))
    algenta.linear_cross_entropy(h, np.ones((300, 8)), np.zeros(300, np.int64), with_grad=True)


# Bugs the fuzz has found in code this file does not own, each reproduced by a strict xfail test
# below: counted under "known <type>" so the run stays a guard against new failures. When one is
# fixed its xfail turns XPASS (a failure, being strict), and its entry here goes too.
KNOWN = {}


def _outcome(thunk, known=None):
    import algenta

    try:
        thunk()
        return "ok", None
    except algenta.errors.AlgentaError as e:
        if not isinstance(e, ValueError) or not hasattr(e, "status"):
            return "bad", f"status error without ValueError/.status: {e!r}"
        return f"status {e.status}", None
    except TypeError:
        return "TypeError", None
    except MemoryError as e:
        return "bad", f"MemoryError (an allocation the inputs did not ask for): {e!r}"
    except Exception as e:  # noqa: BLE001 - anything else is an unclear refusal
        if type(e).__name__ in (known or {}):
            return f"known {type(e).__name__}", None
        return "bad", f"{type(e).__name__}: {e}"


def child(target: str, seed: int, n_cases: int, workdir: str) -> int:
    import warnings

    warnings.simplefilter("ignore")  # ComplexWarning & co.: we judge outcomes, not warnings
    _warm_up()
    cap = None if sanitized() else _limit_address_space()
    print(f"address space cap: {cap}", flush=True)
    rng = random.Random(seed)
    counts, bad = {}, []
    if target == "loader-memmap":  # the read path used where the safetensors package is absent
        sys.modules["safetensors"] = None
    if target.startswith("loader"):
        from algenta.residentk.session import ResidentSession

        blob = (SEED_CKPT / "model.safetensors").read_bytes()
        cfg = json.loads((SEED_CKPT / "config.json").read_text())
        ck = Path(workdir)
    for i in range(n_cases):
        if target == "lossk":
            desc, thunk = lossk_case(rng)
        else:
            r = rng.random()
            st_bytes, cfg_text = blob, json.dumps(cfg)
            if r < 0.6:
                desc, st_bytes = mutate_safetensors(rng, blob)
            elif r < 0.95:
                desc, cfg_text = mutate_config(rng, cfg)
            else:
                d1, st_bytes = mutate_safetensors(rng, blob)
                d2, cfg_text = mutate_config(rng, cfg)
                desc = d1 + " + " + d2
            (ck / "model.safetensors").write_bytes(st_bytes)
            (ck / "config.json").write_text(cfg_text, errors="surrogatepass")
            thunk = lambda: ResidentSession.from_pretrained(ck, progress=False)  # noqa: E731
        print(f"CASE {i}: {desc}", flush=True)
        kind, why = _outcome(thunk, KNOWN.get(target))
        counts[kind] = counts.get(kind, 0) + 1
        if why:
            bad.append(f"case {i} ({desc}): {why}")
            print("BAD", bad[-1], flush=True)
    print("SUMMARY " + json.dumps(counts, sort_keys=True), flush=True)
    return 1 if bad else 0


def run_child(target: str, seed: int, n_cases: int, tmp_path, timeout=240):
    env = dict(os.environ, MALLOC_ARENA_MAX="2", PYTHONWARNINGS="ignore")
    r = subprocess.run([sys.executable, __file__, target, str(seed), str(n_cases), str(tmp_path)],
                       capture_output=True, text=True, timeout=timeout, env=env, cwd=HERE)
    lines = r.stdout.splitlines()
    summary = next((json.loads(l[8:]) for l in lines if l.startswith("SUMMARY ")), None)
    tail = "\n".join(lines[-5:]) + "\n" + r.stderr[-3000:]
    assert r.returncode >= 0, f"fuzz child killed by signal {-r.returncode}; last lines:\n{tail}"
    bad = [l for l in lines if l.startswith("BAD ")]
    assert not bad, "unclear refusals or giant allocations:\n" + "\n".join(bad[:20])
    assert r.returncode == 0 and summary is not None, f"fuzz child exit {r.returncode}:\n{tail}"
    return summary


# ---- the tests -------------------------------------------------------------------------------

def test_seed_checkpoint_loads_and_decodes():
    # The corpus seed must stay valid, or every mutation would be refused for the same reason.
    from algenta.residentk.session import ResidentSession

    s = ResidentSession.from_pretrained(SEED_CKPT, progress=False)
    assert s.config.vocab == 16 and s.config.tie_word_embeddings is False
    assert s.generate([1, 2, 3], 4) == s.generate([1, 2, 3], 4)


def test_tensor_data_at_odd_file_offsets(tmp_path):
    # The format pads its header to 8 bytes, but nothing forces a writer to: with an odd header
    # length every tensor starts at an odd address of the memory map. Values must come out the
    # same, and (checked by tools/sanitize-test's UBSan) without a misaligned 16/32-bit load.
    from algenta.residentk.session import ResidentSession

    meta, data = st_split((SEED_CKPT / "model.safetensors").read_bytes())
    raw = json.dumps(meta).encode()
    raw += b" " * ((1 - len(raw)) % 2)  # odd length
    assert len(raw) % 2 == 1
    (tmp_path / "config.json").write_bytes((SEED_CKPT / "config.json").read_bytes())
    (tmp_path / "model.safetensors").write_bytes(st_join(None, data, raw_header=raw))
    odd = ResidentSession.from_pretrained(tmp_path, progress=False)
    ref = ResidentSession.from_pretrained(SEED_CKPT, progress=False)
    assert odd.prefill([1, 2, 3]).tobytes() == ref.prefill([1, 2, 3]).tobytes()


@pytest.mark.parametrize("name", sorted(p.name for p in (CORPUS / "hostile").iterdir()))
def test_corpus_hostile_files_refused_607(tmp_path, name):
    # Each committed hostile file is the seed checkpoint's model.safetensors with one lie in it.
    from algenta import ResidentError
    from algenta.residentk.session import ResidentSession

    (tmp_path / "config.json").write_bytes((SEED_CKPT / "config.json").read_bytes())
    (tmp_path / "model.safetensors").write_bytes((CORPUS / "hostile" / name).read_bytes())
    with pytest.raises(ResidentError) as e:
        ResidentSession.from_pretrained(tmp_path, progress=False)
    assert e.value.status == 607


@pytest.mark.parametrize("name", sorted(p.name for p in (CORPUS / "hostile_json").iterdir()))
def test_json_nested_past_the_parser_is_refused_not_a_traceback(tmp_path, name):
    # JSON nested deeper than CPython's parser recurses raised RecursionError out of the
    # loader; as config.json, as the shard index, to from_pretrained and to both CLIs, it is a
    # 607 (exit 2 with one line), never a traceback.
    from algenta import ResidentError
    from algenta.residentk.session import ResidentSession

    deep = (CORPUS / "hostile_json" / name).read_bytes()
    (tmp_path / "config.json").write_bytes(deep)
    (tmp_path / "model.safetensors").write_bytes((SEED_CKPT / "model.safetensors").read_bytes())
    with pytest.raises(ResidentError) as e:
        ResidentSession.from_pretrained(tmp_path, progress=False)
    assert e.value.status == 607 and "nested too deeply" in str(e.value)
    for argv in (["plan", "--config", str(tmp_path / "config.json")],
                 ["generate", "--model", str(tmp_path), "--ids", "1"]):
        r = subprocess.run([sys.executable, "-m", "algenta", *argv], capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
        assert len(r.stderr.strip().splitlines()) == 1 and "nested too deeply" in r.stderr
    (tmp_path / "config.json").write_bytes((SEED_CKPT / "config.json").read_bytes())
    (tmp_path / "model.safetensors").rename(tmp_path / "model-00001-of-00001.safetensors")
    (tmp_path / "model.safetensors.index.json").write_bytes(deep)
    with pytest.raises(ResidentError) as e:
        ResidentSession.from_pretrained(tmp_path, progress=False)
    assert e.value.status == 607 and "nested too deeply" in str(e.value)


def test_lossk_targets_of_the_wrong_type_are_a_type_error():
    import algenta

    h, w = np.ones((2, 3), np.float32), np.ones((4, 3), np.float32)
    for bad in (None, 3, "01", object()):
        with pytest.raises(TypeError):
            algenta.linear_cross_entropy(h, w, bad)
    with pytest.raises(TypeError):
        algenta.linear_cross_entropy(h, w, np.array([0.5, 1.0]))


@pytest.mark.parametrize("seed", [1, 2])
def test_fuzz_lossk_flat_api_and_bindings(tmp_path, seed):
    summary = run_child("lossk", seed, CASES, tmp_path)
    # The generator must reach both sides: real results and each family of refusal.
    assert summary.get("ok", 0) > CASES // 20, summary
    assert summary.get("TypeError", 0) > 0, summary
    for st in (581, 582, 583, 585, 586, 587):
        assert summary.get(f"status {st}", 0) > 0, (st, summary)


@pytest.mark.slow
@pytest.mark.parametrize("target,seed", [("loader", 1), ("loader", 2), ("loader-memmap", 3)])
def test_fuzz_checkpoint_loader(tmp_path, target, seed):
    summary = run_child(target, seed, CASES // 2, tmp_path)
    assert summary.get("status 607", 0) > CASES // 10, summary
    assert summary.get("ok", 0) > 0, summary  # harmless mutations still load


def test_fuzz_findings_in_the_lossk_layer_stay_fixed():
    # Each of these once escaped as a bare ValueError or, for complex data, silently dropped the
    # imaginary part and returned a number.
    import algenta
    from algenta import _core
    from algenta.lossk import cross_entropy as ce
    from algenta.lossk._args import CrossEntropyOptions

    with pytest.raises(TypeError):
        ce.fused_linear_ce_flat([[1.0, 2.0], [3.0]] * 2, [1.0] * 4, [0, 1], 2, 2, 2, 1)
    with pytest.raises(TypeError):
        ce.ce_from_logits_flat(np.ones(4, np.complex128), [0, 1], 2, 2)
    with pytest.raises(TypeError):
        algenta.linear_cross_entropy(np.ones((2, 2)), np.ones((2, 2)), [[0], [1, 0]])
    for bad in ("avg", None, 3):
        with pytest.raises(algenta.LossError) as e:
            algenta.linear_cross_entropy(np.ones((2, 2)), np.ones((2, 2)), [0, 1], reduction=bad)
        assert e.value.status == 588
    with pytest.raises(algenta.LossError) as e:
        _core.lossk.fused_linear_ce(CrossEntropyOptions(reduction="avg", chunk=1),
                                    hidden=np.ones(4), weight=np.ones(4),
                                    targets=np.zeros(2, np.int64), n_tok=2, d_model=2, vocab=2,
                                    elem="f64")
    assert e.value.status == 588
    with pytest.raises(algenta.LossError) as e:
        algenta.linear_cross_entropy(np.ones((2, 2)), np.ones((2, 2)), [0, 1], grad_output=np.ones(2))
    assert e.value.status == 582


def _rlimit_python(code: str, headroom=HEADROOM, timeout=120):
    if sanitized():
        pytest.skip("RLIMIT_AS cannot coexist with ASan's shadow memory")
    prog = ("import sys; sys.path.insert(0, %r)\n"
            "from test_fuzz import _warm_up, _limit_address_space\n"
            "_warm_up(); _limit_address_space()\n" % str(HERE)) + code
    return subprocess.run([sys.executable, "-c", prog], capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ, MALLOC_ARENA_MAX="2"))


def test_the_cap_catches_a_giant_allocation():
    # The control for the fuzz children: under the same cap, 2 GiB (never touched, so an
    # overcommitting kernel would hand it out freely) is a MemoryError.
    r = _rlimit_python("import numpy as np\n"
                       "try:\n    np.empty(2**28)\nexcept MemoryError:\n    print('capped')\n")
    assert r.stdout.strip() == "capped", (r.stdout, r.stderr[-2000:])


def test_config_declaring_a_huge_model_is_refused_before_allocating(tmp_path):
    cfg = json.loads((SEED_CKPT / "config.json").read_text())
    cfg.update(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
               intermediate_size=12288, num_hidden_layers=36, vocab_size=151936)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "model.safetensors").write_bytes((SEED_CKPT / "model.safetensors").read_bytes())
    r = _rlimit_python(
        "from algenta import ResidentError\n"
        "from algenta.residentk.session import ResidentSession\n"
        "try:\n"
        f"    ResidentSession.from_pretrained({str(tmp_path)!r}, progress=False)\n"
        "except ResidentError as e:\n"
        "    print('refused', e.status)\n"
        "except MemoryError:\n"
        "    print('MemoryError')\n")
    assert r.stdout.strip() == "refused 607", (r.stdout, r.stderr[-2000:])


def test_config_wrong_typed_tie_flag_is_refused(tmp_path):
    from algenta import ResidentError
    from algenta.residentk.session import ResidentSession

    cfg = json.loads((SEED_CKPT / "config.json").read_text())
    cfg["tie_word_embeddings"] = "false"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "model.safetensors").write_bytes((SEED_CKPT / "model.safetensors").read_bytes())
    with pytest.raises(ResidentError):
        ResidentSession.from_pretrained(tmp_path, progress=False)


def test_safetensors_package_refusals_are_wrapped(tmp_path):
    pytest.importorskip("safetensors")
    from algenta import ResidentError
    from algenta.residentk.session import ResidentSession

    (tmp_path / "config.json").write_bytes((SEED_CKPT / "config.json").read_bytes())
    (tmp_path / "model.safetensors").write_bytes(
        (SEED_CKPT / "model.safetensors").read_bytes() + b"\0\0\0")
    with pytest.raises(ResidentError) as e:
        ResidentSession.from_pretrained(tmp_path, progress=False)
    assert e.value.status == 607


def test_config_huge_integer_rope_theta_is_refused(tmp_path):
    from algenta import ResidentError
    from algenta.residentk.session import ResidentSession

    cfg = json.loads((SEED_CKPT / "config.json").read_text())
    cfg["rope_theta"] = 10**400
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "model.safetensors").write_bytes((SEED_CKPT / "model.safetensors").read_bytes())
    with pytest.raises(ResidentError):
        ResidentSession.from_pretrained(tmp_path, progress=False)


@pytest.mark.parametrize("key,value", [("num_hidden_layers", 2**64), ("hidden_size", 2**63),
                                       ("architectures", 2)])
def test_config_fields_past_int64_or_of_the_wrong_shape_get_a_status(tmp_path, key, value):
    from algenta import ResidentError
    from algenta.residentk.session import ResidentSession

    cfg = json.loads((SEED_CKPT / "config.json").read_text())
    cfg[key] = value
    if key == "architectures":
        cfg.pop("model_type")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "model.safetensors").write_bytes((SEED_CKPT / "model.safetensors").read_bytes())
    with pytest.raises(ResidentError):
        ResidentSession.from_pretrained(tmp_path, progress=False)


if __name__ == "__main__":
    sys.exit(child(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]))
