"""The CUDA session's host-side launch plan (cpp/src/session_cuda_plan.cpp), checked in every
build with no GPU: grid sizes cover every row exactly once, split-K ranges partition the keys,
scratch is sized once to the contract's ceiling, every buffer offset is aligned and no two
buffers overlap, and the launch count per token equals the contract's dispatch budget.

Expected values come from the residentk contract (an independent module with its own suites)
or from the definitions restated here in Python, never from the plan itself."""

from __future__ import annotations

import math

import pytest

from algenta import _core
from algenta import ResidentUnavailableError
from algenta.residentk.session import ResidentSession

RC = _core.residentk
CP = _core.session.cuda_plan
COMPILED = _core.session.cuda_backend()["kind"] != "none"
ALIGN = CP.ALIGN_FLOATS
ALIGN_BYTES = CP.ALIGN_BYTES
FORMATS = ["f32", "bf16", "f16", "int8"]
ELEM_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "int8": 1}

QWEN3_06B = dict(d_model=1024, h_q=16, h_kv=8, d_head=128, d_ff=3072, n_layers=28, vocab=151936)
SHAPES = {
    "qwen3_06b": QWEN3_06B,
    "awkward_untied": dict(d_model=52, h_q=4, h_kv=2, d_head=16, d_ff=84, n_layers=2, vocab=101),
    "mha_tied": dict(d_model=40, h_q=2, h_kv=2, d_head=32, d_ff=72, n_layers=3, vocab=89),
    "dh1_odd": dict(d_model=7, h_q=3, h_kv=1, d_head=1, d_ff=5, n_layers=1, vocab=3),
}


def plan(shape, *, tied=True, max_ctx=512, sms=132, eps=1e-6, theta=1e6, weights="f32"):
    s = SHAPES[shape] if isinstance(shape, str) else shape
    return CP.make_plan(s["d_model"], s["h_q"], s["h_kv"], s["d_head"], s["d_ff"], s["n_layers"],
                        s["vocab"], eps, theta, tied, max_ctx, sms, weights=weights)


@pytest.mark.parametrize("rows", [1, 7, 8, 9, 63, 64, 65, 1000, 3072, 4096, 151936])
@pytest.mark.parametrize("sms", [1, 40, 108, 132])
def test_matvec_launch_covers_every_row_once(rows, sms):
    m = CP.matvec_launch(rows, sms)
    rpb, grid = m["rows_per_block"], m["grid"]
    assert m["rows"] == rows
    assert rpb % CP.MATVEC_WARPS == 0 and rpb >= CP.MATVEC_WARPS
    assert grid * rpb >= rows and (grid - 1) * rpb < rows  # no block without a row
    # Aim: about MATVEC_BLOCKS_PER_SM blocks per SM once there are enough rows to fill them.
    target = sms * CP.MATVEC_BLOCKS_PER_SM
    assert grid <= max(target, 1) or rpb == CP.MATVEC_WARPS
    if rows >= target * CP.MATVEC_WARPS:
        assert grid > target // 2


UNIT = {"f32": 4, "bf16": 8, "f16": 8, "int8": 32}  # a slice's start: a 16-byte load, an int8 block
MIN_SLICE = {"f32": 128, "bf16": 256, "f16": 256, "int8": 512}  # 32 lanes x 16 bytes


@pytest.mark.parametrize("rows", [1, 8, 64, 512, 1024, 3072, 4096])
@pytest.mark.parametrize("K", [52, 256, 1000, 1024, 1536, 2048, 3072])
@pytest.mark.parametrize("weights", FORMATS)
@pytest.mark.parametrize("sms", [40, 132])
def test_decode_matvec_launch_splits_short_matrices(rows, K, weights, sms):
    m = CP.decode_matvec_launch(rows, K, weights, sms)
    base = CP.matvec_launch(rows, sms)
    s = m["split"]
    assert m["rows"] == rows and s in (1, 2, 4, 8)
    assert m["grid"] * m["rows_per_block"] >= rows > (m["grid"] - 1) * m["rows_per_block"]

    def slice_ok(n):  # K in n slices, each whole units and one 16-byte load a lane or more
        return K % n == 0 and (K // n) % UNIT[weights] == 0 and K // n >= MIN_SLICE[weights]

    def flight(n):  # blocks an SM (at most the aim) x a lane's bytes in flight
        grid = math.ceil(rows / (CP.MATVEC_WARPS // n)) if n > 1 else base["grid"]
        lane = min(16 * CP.MATVEC_LOADS, (K // n) * ELEM_BYTES[weights] / 32)
        return min(grid / sms, CP.MATVEC_BLOCKS_PER_SM) * lane

    if base["rows_per_block"] > CP.MATVEC_WARPS:
        assert m == dict(base, split=1)  # rows enough: one warp a row
        return
    allowed = [1] + [n for n in (2, 4, 8) if all(slice_ok(j) for j in (2, 4, 8) if j <= n)]
    assert s in allowed and m["rows_per_block"] == CP.MATVEC_WARPS // s
    # the most bytes in flight, the fewest warps a row on a tie
    assert all(flight(n) <= flight(s) * (1 + 1e-12) for n in allowed), (allowed, s)
    assert all(flight(n) < flight(s) for n in allowed if n < s)


def test_matvec_min_slice_is_one_load_a_lane():
    assert {f: CP.matvec_min_slice(f) for f in FORMATS} == MIN_SLICE


def test_qwen3_06b_matvecs_hold_hbm_latency_in_flight():
    # Every decode matvec at the 0.6B shape on an H200 (132 SMs) holds, by the plan's count, at
    # least the 25.5 KB an SM that 4.8 TB/s over ~700 ns of latency asks (perf/cuda_static.py),
    # or the whole matrix (int8's o_proj, 2 MB, is smaller than that on all SMs). o_proj and
    # down split over warps where that holds more: unsplit they have one block an SM.
    need = 4.8e12 * 700e-9 / 132
    A = QWEN3_06B["h_q"] * QWEN3_06B["d_head"]
    D, F = QWEN3_06B["d_model"], QWEN3_06B["d_ff"]
    for f in FORMATS:
        p = plan("qwen3_06b", sms=132, weights=f)
        for name, K in (("qkv_mv", D), ("o_mv", A), ("gateup_mv", D), ("down_mv", F)):
            mv = p[name]
            lane = min(16 * CP.MATVEC_LOADS, (K // mv["split"]) * ELEM_BYTES[f] / 32)
            held = min(mv["grid"] / 132, CP.MATVEC_BLOCKS_PER_SM) * CP.MATVEC_THREADS * lane
            whole = mv["rows"] * K * ELEM_BYTES[f] / 132  # the matrix, an SM's share
            assert held >= min(need, whole), (f, name, held, whole)
        if f != "int8":  # int8's 64-byte rows a lane: o_proj is in flight whole unsplit
            assert p["o_mv"]["split"] > 1 and p["down_mv"]["split"] > 1, f


def test_matvec_launch_degenerate_inputs():
    assert CP.matvec_launch(0, 132) == {"rows": 0, "rows_per_block": 0, "grid": 0, "split": 1}
    assert CP.matvec_launch(1000, 0) == CP.matvec_launch(1000, CP.FALLBACK_SMS)


@pytest.mark.parametrize("n", list(range(1, 70)) + [127, 128, 999, 1000, 4097, 65536])
def test_splitk_ranges_partition_the_keys(n):
    for S in sorted({1, 2, 3, 7, 31, 32, 80, 256, min(n, 256)}):
        per = math.ceil(n / S)
        ranges = [CP.splitk_range(n, S, s) for s in range(S)]
        covered = 0
        seen_empty = False
        for k0, k1 in ranges:
            assert k0 == covered and k0 <= k1 <= n and k1 - k0 <= per
            if k1 == k0:
                seen_empty = True
            else:
                assert not seen_empty  # the non-empty splits form a prefix
            covered = k1
        assert covered == n


@pytest.mark.parametrize("sms,h_q", [(40, 16), (132, 16), (132, 1), (1, 64), (0, 16)])
def test_splitk_plan_follows_the_contract(sms, h_q):
    cap = RC.residentk_splitk_max_n_splits(sms, h_q)
    for n in [1, 2, 31, 32, 33, 64, 128, 500, 1000, 4096, 65536]:
        sp = CP.splitk_plan(n, sms, h_q)
        if not RC.residentk_splitk_should_split(n):
            assert sp == {"split": False, "n_splits": 1, "launches": 1}
            continue
        want = min(RC.residentk_splitk_policy(n, sms, h_q), n)
        assert sp == {"split": True, "n_splits": want, "launches": 2}
        assert 1 <= sp["n_splits"] <= cap  # the scratch sized once to the cap always holds it


def test_splitk_reference_anchors():
    # The contract's calibrated anchors survive the plan's clamp to n_keys.
    assert CP.splitk_plan(128, 40, 16)["n_splits"] == 40
    assert CP.splitk_plan(1000, 40, 16)["n_splits"] == 80


def _regions_disjoint_aligned(regions, total, align=ALIGN):
    regions = sorted(regions)
    for off, size, name in regions:
        assert off % align == 0, name
        assert size >= 1, name
    for (o1, s1, n1), (o2, _, n2) in zip(regions, regions[1:]):
        assert o1 + s1 <= o2, f"{n1} overlaps {n2}"
    assert regions[-1][0] + regions[-1][1] <= total
    assert total % align == 0


@pytest.mark.parametrize("weights", FORMATS)
@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_weight_arena_offsets(shape, tied, weights):
    s = SHAPES[shape]
    p = plan(shape, tied=tied, weights=weights)
    assert p["status"] == 600, p["why"]
    D, Hq, Hkv, Dh, F, L, V = (s[k] for k in ("d_model", "h_q", "h_kv", "d_head", "d_ff",
                                               "n_layers", "vocab"))
    Q = (Hq + 2 * Hkv) * Dh
    e = ELEM_BYTES[weights]
    assert p["elem_bytes"] == e
    regions = []

    def mat(m, rows, cols, name):  # a matrix's codes, and for int8 its block scales
        regions.append((m["data"], rows * cols * e, name))
        if weights == "int8":
            regions.append((m["scales"], 4 * rows * math.ceil(cols / 32), name + ".scales"))
        else:
            assert m["scales"] == -1, name

    mat(p["embed"], V, D, "embed")
    regions.append((p["final_norm"], 4 * D, "final_norm"))
    for i, l in enumerate(p["layers"]):
        regions += [(l["in_norm"], 4 * D, f"{i}.in_norm"), (l["q_norm"], 4 * Dh, f"{i}.q_norm"),
                    (l["k_norm"], 4 * Dh, f"{i}.k_norm"), (l["post_norm"], 4 * D, f"{i}.post")]
        mat(l["wqkv"], Q, D, f"{i}.wqkv")
        mat(l["wo"], D, Hq * Dh, f"{i}.wo")
        mat(l["wg"], F, D, f"{i}.wg")
        mat(l["wu"], F, D, f"{i}.wu")
        mat(l["wd"], D, F, f"{i}.wd")
    assert len(p["layers"]) == L
    if tied:
        assert p["head"] == p["embed"]
    else:
        mat(p["head"], V, D, "head")
    _regions_disjoint_aligned(regions, p["weight_bytes"], ALIGN_BYTES)
    # The arena is the contract's weight bytes in this format plus at most one alignment pad per
    # region.
    fp = RC.residentk_footprint(D, Hq, Hkv, Dh, F, L, V, 512, tied, 1, True, format=weights)
    assert fp["status"] == 600
    assert fp["weight_bytes"] <= p["weight_bytes"] <= fp["weight_bytes"] + ALIGN_BYTES * len(regions)
    # The staged vector's shared memory, in the kernels' layout.
    K = max(D, F, Hq * Dh)
    want = 16 * math.ceil(K / 4)
    if weights == "int8":
        want += 16 * math.ceil(K / 16) + 4 * math.ceil(K / 32)
    assert p["staged_bytes"] == want


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("max_ctx,sms", [(1, 132), (600, 40), (65536, 132)])
def test_cache_activation_and_prefill_arenas(shape, max_ctx, sms):
    s = SHAPES[shape]
    D, Hq, Hkv, Dh, F, L, V = (s[k] for k in ("d_model", "h_q", "h_kv", "d_head", "d_ff",
                                               "n_layers", "vocab"))
    p = plan(shape, max_ctx=max_ctx, sms=sms)
    assert p["status"] == 600, p["why"]
    T = p["capacity"]
    assert T == RC.resident_bucket_ctx(max_ctx)
    assert p["kv_elems"] == RC.residentk_cache_elements(L, Hkv, Dh, T)
    assert p["kv_layer_stride"] * L == p["kv_elems"]
    assert p["kv_elem_bytes"] == 4
    for kv, size in (("bf16", 2), ("f16", 2)):
        pk = CP.make_plan(D, Hq, Hkv, Dh, F, L, V, 1e-6, 1e6, True, max_ctx, sms, kv=kv)
        assert (pk["kv_elems"], pk["kv_elem_bytes"]) == (p["kv_elems"], size)
    assert p["rope_floats"] == 2 * T * max(Dh // 2, 1)
    Q, A = (Hq + 2 * Hkv) * Dh, Hq * Dh
    assert (p["q_rows"], p["attn_width"]) == (Q, A)
    S = RC.residentk_splitk_max_n_splits(sms, Hq)
    assert p["max_splits"] == S and p["sms"] == sms
    head_grid = CP.matvec_launch(V, sms)["grid"]
    assert p["head_mv"] == CP.matvec_launch(V, sms)
    _regions_disjoint_aligned(
        [(p["x"], D, "x"), (p["xf"], D, "xf"), (p["qkv"], Q, "qkv"), (p["attn"], A, "attn"),
         (p["act"], F, "act"), (p["logits"], V, "logits"), (p["part_acc"], Hq * S * Dh, "part_acc"),
         (p["part_ml"], Hq * S * 2, "part_ml"), (p["argmax_val"], head_grid, "argmax_val")],
        p["act_floats"])
    M = min(CP.PREFILL_BLOCK, T)
    assert p["prefill_rows"] == M
    _regions_disjoint_aligned(
        [(p["p_x"], M * D, "p_x"), (p["p_xn"], M * D, "p_xn"), (p["p_qkv"], M * Q, "p_qkv"),
         (p["p_attn"], M * A, "p_attn"), (p["p_gate"], M * F, "p_gate"),
         (p["p_up"], M * F, "p_up")],
        p["prefill_floats"])
    assert p["q8_ld"] == 0  # f32 weights: no quantized activations
    pq = CP.make_plan(D, Hq, Hkv, Dh, F, L, V, 1e-6, 1e6, True, max_ctx, sms, weights="int8")
    ld = math.ceil(max(D, F, A) / 32) * 32
    assert pq["q8_ld"] == ld
    _regions_disjoint_aligned(
        [(pq["p_x"], M * D, "p_x"), (pq["p_up"], M * F, "p_up"),
         (pq["p_q8_codes"], math.ceil(M * ld / 4), "codes"),
         (pq["p_q8_scales"], M * ld // 32, "scales")], pq["prefill_floats"])
    assert p["staged_floats"] == max(D, F, A)
    assert p["attn_smem_bytes"] == 4 * (Dh + CP.ATTN_WARPS * Dh + 2 * CP.ATTN_WARPS)
    nrt = p["norm_rope_threads"]
    assert nrt % 32 == 0 and 32 <= nrt <= 1024 and nrt >= min(max(Dh // 2, 1), 1024)
    for name, rows, K in [("qkv_mv", Q, D), ("o_mv", D, A), ("gateup_mv", F, D),
                          ("down_mv", D, F)]:
        assert p[name] == CP.decode_matvec_launch(rows, K, "f32", sms), name


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_decode_launches_equal_the_dispatch_budget(shape):
    L = SHAPES[shape]["n_layers"]
    p = plan(shape, max_ctx=65536)
    for n_keys, launches in p["decode_launches"]:
        if RC.residentk_splitk_should_split(n_keys):
            assert launches == RC.residentk_dispatch_budget_deep(L), n_keys
        else:
            assert launches == RC.residentk_dispatch_budget(L), n_keys


def test_qwen3_06b_plan_figures():
    p = plan("qwen3_06b", sms=132)
    # Tied: weights = residentk_weight_elems at 512 minus the KV cache, pads included at most.
    want = RC.residentk_weight_elems(1024, 16, 8, 128, 3072, 28, 151936, 512, True) - \
        RC.residentk_cache_elements(28, 8, 128, 512)
    assert want == 596_049_920
    assert 0 <= p["weight_bytes"] - 4 * want < ALIGN_BYTES * (2 + 9 * 28)
    assert p["kv_elems"] == 29_360_128
    assert p["staged_floats"] == 3072 and p["staged_floats"] * 4 <= RC.residentk_smem_tier_bytes()
    assert p["max_splits"] == RC.residentk_splitk_max_n_splits(132, 16) == 256
    assert p["qkv_mv"]["rows"] == 4096 and p["head_mv"]["rows"] == 151936


@pytest.mark.parametrize("m", [1, 5, 31, 32, 33, 64, 255, 256])
@pytest.mark.parametrize("n", [1, 63, 64, 65, 4096])
def test_prefill_gemm_grid(m, n):
    g = CP.prefill_gemm_grid(m, n, 132)
    assert g["narrow"] == RC.residentk_prefill_gemm_use_narrow_tile(m)
    if g["narrow"]:
        mv = CP.matvec_launch(n, 132)
        assert (g["gx"], g["gy"], g["rows_per_block"]) == (mv["grid"], 1, mv["rows_per_block"])
    else:
        assert g["gx"] == math.ceil(n / CP.GEMM_BN) and g["gy"] == math.ceil(m / CP.GEMM_BM)


@pytest.mark.parametrize("args,status", [
    (dict(h_q=5, h_kv=2), 603),          # GQA group not an integer
    (dict(d_head=48), 603),              # not a power of two
    (dict(d_model=0), 601),
    (dict(vocab=RC.RESIDENT_MAX_VOCAB + 1), 602),
    (dict(d_ff=20000), 602),             # staged vector past the 48 KiB tier
])
def test_plan_refuses_what_the_contract_refuses(args, status):
    s = {**QWEN3_06B, **args}
    p = plan(s)
    assert p["status"] == status and p["why"]
    assert RC.residentk_shape_check(*(s[k] for k in ("d_model", "h_q", "h_kv", "d_head", "d_ff",
                                                     "n_layers", "vocab")))[0] == status
    assert set(p) == {"status", "why"}  # nothing sized for a refused shape


def test_plan_refuses_scalars_and_context():
    assert plan("mha_tied", eps=float("nan"))["status"] == 609
    assert plan("mha_tied", theta=0.0)["status"] == 609
    assert plan("mha_tied", max_ctx=0)["status"] == 601
    assert plan("mha_tied", max_ctx=65537)["status"] == 602


@pytest.mark.cuda
@pytest.mark.skipif(COMPILED, reason="expectation of a build without a CUDA backend")
def test_cpu_build_cuda_factory_refuses_604():
    s = SHAPES["mha_tied"]
    with pytest.raises(ResidentUnavailableError) as e:
        _core.session.cuda_session(s["d_model"], s["h_q"], s["h_kv"], s["d_head"], s["d_ff"],
                                   s["n_layers"], s["vocab"], 1e-6, 1e6, True, 64)
    assert e.value.status == 604
    with pytest.raises(ResidentUnavailableError) as e:
        _core.session.cuda_copy_bandwidth(1 << 20, 2)
    assert e.value.status == 604
    assert _core.session.cuda_backend()["kind"] == "none" and not RC.resident_available()


@pytest.mark.cuda
@pytest.mark.skipif(not COMPILED or RC.resident_available(),
                    reason="needs the ALGENTA_GPU=ON build on a host without a usable device")
def test_gpu_build_without_device_refuses_605_before_allocating():
    s = SHAPES["qwen3_06b"]
    # 605, not 608 and not an allocation: the device question is asked before any cudaMalloc.
    with pytest.raises(ResidentUnavailableError) as e:
        _core.session.cuda_session(s["d_model"], s["h_q"], s["h_kv"], s["d_head"], s["d_ff"],
                                   s["n_layers"], s["vocab"], 1e-6, 1e6, True, 65536)
    assert e.value.status == 605
    # The contract's refusals still come first (603 on every host).
    with pytest.raises(Exception) as e:
        _core.session.cuda_session(1024, 5, 2, 128, 3072, 2, 151936, 1e-6, 1e6, True, 64)
    assert e.value.status == 603
    with pytest.raises(ResidentUnavailableError) as e:
        ResidentSession.random(**SHAPES["mha_tied"], device="cuda")
    assert e.value.status == 605
    assert ResidentSession.random(**SHAPES["mha_tied"], device="auto").device == "cpu"


def test_the_plan_sizes_every_slot_and_the_row_kernels():
    base = dict(d_model=1024, h_q=16, h_kv=8, d_head=128, d_ff=3072, n_layers=28,
                vocab=151936)
    args = [base[k] for k in ("d_model", "h_q", "h_kv", "d_head", "d_ff", "n_layers",
                              "vocab")] + [1e-6, 1e6, True, 4096, 132]
    one = CP.make_plan(*args, weights="bf16")
    six = CP.make_plan(*args, weights="bf16", slots=6)
    many = CP.make_plan(*args, weights="bf16", slots=40)
    assert one["kv_elems"] == one["kv_slot_stride"] and one["step_rows"] == 1
    assert six["kv_elems"] == 6 * one["kv_elems"] and six["step_rows"] == 6
    assert many["step_rows"] == 16 and many["row_entries"] == max(16, many["prefill_rows"])
    assert six["weight_bytes"] == one["weight_bytes"]
    # a row of the activations for each row a launch carries
    assert six["logits"] - six["act"] == 6 * 3072 and six["act_floats"] > one["act_floats"]
    assert CP.make_plan(*args, slots=0)["status"] == 601
    assert CP.make_plan(*args, slots=1025)["status"] == 602
    # rows a matvec block stages: 8, fewer where they would not fit beside 1 KiB, at least 1
    stride = CP.stage_stride(3072, "f32")
    assert stride == 12288 and CP.stage_stride(100, "int8") % 16 == 0
    assert CP.matvec_pass_rows(stride, 232448) == 8
    assert CP.matvec_pass_rows(4 * stride, 232448) == 4
    assert CP.matvec_pass_rows(232448, 232448) == 1
