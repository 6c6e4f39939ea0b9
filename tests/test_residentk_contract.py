"""residentk.contract: every function, success and refusal, with the seed's numbers pinned."""

import math

import numpy as np
import pytest

import algenta
from algenta.residentk import contract as rc

QWEN3_06B = (1024, 16, 8, 128, 3072, 28, 151936)


def test_status_names_cover_600_to_610():
    expected = {
        600: "resident_ok", 601: "resident_empty_dimension", 602: "resident_dimension_too_large",
        603: "resident_head_geometry_unsupported", 604: "resident_shader_toolchain_absent",
        605: "resident_no_accelerator_present", 606: "resident_kv_context_full",
        607: "resident_weight_length_mismatch", 608: "resident_launch_failed",
        609: "resident_non_finite_scalar", 610: "resident_code_out_of_range",
    }
    for code, name in expected.items():
        assert rc.residentk_status_name(code) == name
    assert len(set(expected.values())) == 11


@pytest.mark.parametrize("code", [599, 611, 619, 580, 0, -600, 2**63 - 1, 2**63, -(2**70)])
def test_status_name_out_of_range(code):
    assert rc.residentk_status_name(code) == "resident_code_out_of_range"


def test_status_name_type():
    with pytest.raises(TypeError):
        rc.residentk_status_name("600")
    with pytest.raises(TypeError):
        rc.residentk_status_name(600.0)


def test_constants():
    assert rc.RESIDENT_MAX_CONTEXT == 65536
    assert rc.RESIDENT_DEFAULT_CONTEXT == 512
    assert rc.RESIDENT_OK == 600 and rc.RESIDENT_CODE_OUT_OF_RANGE == 610
    assert rc.RESIDENT_MAX_STAGED_FLOATS == rc.residentk_smem_tier_bytes() // 4
    # The documented CMake default; CI builds never override it.
    assert rc.residentk_smem_tier_bytes() == 49152


def test_errors_module_names_resident_codes():
    e = algenta.errors.from_status("residentk", 603, "bad heads")
    assert isinstance(e, algenta.ResidentError) and isinstance(e, ValueError)
    assert e.status_name == "resident_head_geometry_unsupported"
    for code in (604, 605, 608):
        u = algenta.errors.from_status("residentk", code, "x")
        assert isinstance(u, algenta.ResidentUnavailableError) and isinstance(u, RuntimeError)


# ---- dims ------------------------------------------------------------------------------------

@pytest.mark.smoke
def test_dims_check_qwen3_06b_passes_without_hq_dhead_equal_dmodel():
    assert 16 * 128 != 1024
    assert rc.residentk_dims_check(1024, 16, 8, 128, 3072) == 600


@pytest.mark.parametrize("dims", [(0, 16, 8, 128, 3072), (1024, 0, 8, 128, 3072),
                                  (1024, 16, 0, 128, 3072), (1024, 16, 8, 0, 3072),
                                  (1024, 16, 8, 128, 0), (-1, 16, 8, 128, 3072),
                                  (-(2**80), 16, 8, 128, 3072)])
def test_dims_check_empty(dims):
    assert rc.residentk_dims_check(*dims) == 601


@pytest.mark.parametrize("dims", [(2**16 + 1, 16, 8, 128, 3072), (1024, 1025, 1, 128, 3072),
                                  (1024, 16, 1025, 128, 3072), (1024, 16, 8, 2048, 3072),
                                  (1024, 16, 8, 128, 2**18 + 1), (2**63 - 1, 16, 8, 128, 3072),
                                  (2**200, 16, 8, 128, 3072)])
def test_dims_check_past_ceiling(dims):
    assert rc.residentk_dims_check(*dims) == 602


@pytest.mark.parametrize("dims", [(1024, 5, 2, 128, 3072), (1024, 8, 16, 128, 3072),
                                  (1024, 16, 8, 96, 3072), (1024, 16, 8, 127, 3072)])
def test_dims_check_head_geometry(dims):
    assert rc.residentk_dims_check(*dims) == 603


def test_emptiness_before_ceiling_before_geometry():
    # One empty dimension wins over another past its ceiling, whatever the argument order.
    assert rc.residentk_dims_check(2**40, 16, 8, 128, 0) == 601
    assert rc.residentk_dims_check(2**40, 5, 2, 128, 3072) == 602


def test_dims_check_shared_memory_tier():
    cap = rc.RESIDENT_MAX_STAGED_FLOATS
    assert rc.residentk_dims_check(1024, 16, 8, 128, cap) == 600          # exactly at the tier
    assert rc.residentk_dims_check(1024, 16, 8, 128, cap + 1) == 602      # d_ff one float over
    assert rc.residentk_dims_check(cap + 1, 16, 8, 128, 3072) == 602      # d_model over
    # h_q * d_head is staged too (the q projection output), not only d_model and d_ff.
    assert rc.residentk_dims_check(1024, cap // 64, 8, 128, 3072) == 602
    st, why = rc.residentk_shape_reason(5120, 40, 8, 128, 17408, 40, 151936)   # Qwen3-14B
    assert st == 602 and "d_ff" in why and "ALGENTA_SMEM_TIER_BYTES=69632" in why
    st, why = rc.residentk_shape_reason(1024, 16, 8, 128, 60000, 4, 1000)   # 240,000 bytes
    assert st == 602 and "no tier holds it" in why


def test_shape_check_adds_layers_and_vocab():
    assert rc.residentk_shape_check(*QWEN3_06B) == 600
    assert rc.residentk_shape_reason(*QWEN3_06B) == (600, "")
    assert rc.residentk_shape_check(1024, 16, 8, 128, 3072, 0, 151936) == 601
    assert rc.residentk_shape_check(1024, 16, 8, 128, 3072, 28, 0) == 601
    assert rc.residentk_shape_check(1024, 16, 8, 128, 3072, 1025, 151936) == 602
    assert rc.residentk_shape_check(1024, 16, 8, 128, 3072, 28, 2**22 + 1) == 602
    st, why = rc.residentk_shape_reason(1024, 5, 2, 128, 3072, 2, 151936)
    assert st == 603 and "multiple" in why
    st, why = rc.residentk_shape_reason(1024, 16, 8, 96, 3072, 2, 151936)
    assert st == 603 and "power of two" in why


def test_dims_types():
    with pytest.raises(TypeError):
        rc.residentk_dims_check(1024.0, 16, 8, 128, 3072)
    with pytest.raises(TypeError):
        rc.residentk_dims_check(True, 16, 8, 128, 3072)
    assert rc.residentk_dims_check(np.int64(1024), np.int32(16), 8, 128, 3072) == 600


# ---- context ---------------------------------------------------------------------------------

def test_context_check():
    assert rc.residentk_context_check(100, 412, 512) == 600
    assert rc.residentk_context_check(100, 413, 512) == 606
    assert rc.residentk_context_check(513, 0, 512) == 606
    assert rc.residentk_context_check(1, 0, 1) == 600
    assert rc.residentk_context_check(1, 65535, 65536) == 600
    assert rc.residentk_context_check(1, 1, 65537) == 602
    assert rc.residentk_context_check(0, 1, 512) == 601
    assert rc.residentk_context_check(1, -1, 512) == 601
    assert rc.residentk_context_check(1, 1, 0) == 601
    # A sum that would wrap int64 must still read as "does not fit".
    assert rc.residentk_context_check(10, 2**63 - 1, 512) == 606
    assert rc.residentk_context_check(2**63 - 1, 2**63 - 1, 65536) == 606
    assert rc.residentk_context_check(5, 2**90, 512) == 606


# ---- sizes -----------------------------------------------------------------------------------

def test_cache_elements_seed_values():
    assert rc.residentk_cache_elements(28, 8, 128, 512) == 29_360_128
    assert rc.residentk_cache_elements(28, 8, 128, 65536) == 3_758_096_384
    assert rc.residentk_cache_elements(1, 1, 1, 1) == 2


@pytest.mark.parametrize("args", [(0, 8, 128, 512), (28, 0, 128, 512), (28, 8, 0, 512),
                                  (28, 8, 128, 0), (28, 8, 128, 65537), (2**63 - 1, 8, 128, 512),
                                  (28, 2**64, 128, 512)])
def test_cache_elements_malformed_is_zero(args):
    assert rc.residentk_cache_elements(*args) == 0


def test_dispatch_budgets():
    assert rc.residentk_dispatch_budget(28) == 171
    assert rc.residentk_dispatch_budget(1) == 9
    assert rc.residentk_dispatch_budget_deep(28) == 1 + 28 * 7 + 2 == 199
    assert rc.residentk_dispatch_budget_deep(1024) == 7171
    for bad in (0, -3, 1025, 2**63 - 1, 2**70):
        assert rc.residentk_dispatch_budget(bad) == 0
        assert rc.residentk_dispatch_budget_deep(bad) == 0


def _weights_reference(d, hq, hkv, dh, ff, n_layers, vocab, ctx, tied=True):
    """Term by term in Python's unbounded ints, written independently of the C++."""
    q, k, v, o = d * hq * dh, d * hkv * dh, d * hkv * dh, hq * dh * d
    mlp = 3 * d * ff
    norms = 2 * d + 2 * dh
    per_layer = q + k + v + o + mlp + norms
    emb = vocab * d * (1 if tied else 2)
    return n_layers * per_layer + emb + d + n_layers * 2 * ctx * hkv * dh


def test_weight_elems_qwen3_06b_exact():
    assert rc.residentk_weight_elems(*QWEN3_06B) == 625_410_048
    assert rc.residentk_weight_elems(*QWEN3_06B, 512) == 625_410_048
    assert _weights_reference(*QWEN3_06B, 512) == 625_410_048
    # Weights alone are Qwen3-0.6B's published 596,049,920 parameters (tied embedding once).
    assert 625_410_048 - rc.residentk_cache_elements(28, 8, 128, 512) == 596_049_920


def test_weight_elems_untied_counts_the_lm_head():
    tied = rc.residentk_weight_elems(*QWEN3_06B)
    untied = rc.residentk_weight_elems(*QWEN3_06B, tied=False)
    assert untied - tied == 151936 * 1024
    q8 = (4096, 32, 8, 128, 12288, 36, 151936)  # Qwen3-8B: separate lm_head
    assert rc.residentk_weight_elems(*q8, 4096, tied=False) == _weights_reference(*q8, 4096, tied=False)


@pytest.mark.parametrize("shape", [(64, 4, 2, 16, 96, 3, 97), (256, 8, 1, 64, 1000, 5, 50257),
                                   (4096, 32, 8, 128, 12288, 36, 151936)])
@pytest.mark.parametrize("ctx", [1, 512, 3000, 65536])
def test_weight_elems_matches_reference(shape, ctx):
    assert rc.residentk_weight_elems(*shape, ctx) == _weights_reference(*shape, ctx)


def test_weight_elems_zero_for_unsupported():
    assert rc.residentk_weight_elems(1024, 5, 2, 128, 3072, 28, 151936) == 0
    assert rc.residentk_weight_elems(1024, 16, 8, 128, 3072, 0, 151936) == 0
    assert rc.residentk_weight_elems(*QWEN3_06B, 0) == 0
    assert rc.residentk_weight_elems(*QWEN3_06B, 65537) == 0
    assert rc.residentk_weight_elems(2**63 - 1, 16, 8, 128, 3072, 28, 151936) == 0
    with pytest.raises(TypeError):
        rc.residentk_weight_elems(*QWEN3_06B, tied=1)


def test_weight_elems_at_every_ceiling_does_not_wrap():
    # The largest shape the ceilings admit with a tier-sized staged vector: exact, positive.
    cap = rc.RESIDENT_MAX_STAGED_FLOATS
    dims = (cap, 1024, 1024, 1, cap, rc.RESIDENT_MAX_LAYERS, rc.RESIDENT_MAX_VOCAB)
    got = rc.residentk_weight_elems(*dims, 65536, tied=False)
    assert got == _weights_reference(*dims, 65536, tied=False) and 0 < got < 2**63


def test_footprint_terms_and_tensor_parallel():
    f = rc.residentk_footprint(*QWEN3_06B)
    assert f["status"] == 600 and f["reason"] == ""
    assert f["attn"] + f["mlp"] + f["norms"] + f["embed"] + f["lm_head"] == f["weights"]
    assert f["weights"] == 596_049_920 and f["kv_cache"] == 29_360_128
    assert f["total"] == 625_410_048 and f["kv_per_pos"] == 28 * 2 * 8 * 128
    f2 = rc.residentk_footprint(*QWEN3_06B, tp=2)
    assert f2["attn"] * 2 == f["attn"] and f2["mlp"] * 2 == f["mlp"]
    assert f2["embed"] == f["embed"] and f2["norms"] == f["norms"]
    assert f2["kv_cache"] * 2 == f["kv_cache"]
    for bad_tp in (0, -1, 3, 16):   # 16 does not divide h_kv = 8
        g = rc.residentk_footprint(*QWEN3_06B, tp=bad_tp)
        assert g["status"] == 603 and g["total"] == 0 and "tensor-parallel" in g["reason"]
    assert rc.residentk_footprint(*QWEN3_06B, 70000)["status"] == 602


def test_footprint_check_tier_false_sizes_a_bigger_tier():
    q14 = (5120, 40, 8, 128, 17408, 40, 151936)
    assert rc.residentk_footprint(*q14, tied=False)["status"] == 602
    f = rc.residentk_footprint(*q14, tied=False, check_tier=False)
    assert f["status"] == 600 and f["total"] == _weights_reference(*q14, 512, tied=False)
    # Other refusals are still refusals.
    assert rc.residentk_footprint(1024, 5, 2, 128, 3072, 2, 9, check_tier=False)["status"] == 603


def test_max_ctx_fitting():
    total_512 = 625_410_048 * 4
    per_pos = 28 * 2 * 8 * 128 * 4
    assert rc.residentk_max_ctx_fitting(*QWEN3_06B, total_512) == 512
    assert rc.residentk_max_ctx_fitting(*QWEN3_06B, total_512 - 1) == 0
    assert rc.residentk_max_ctx_fitting(*QWEN3_06B, total_512 + 512 * per_pos) == 1024
    assert rc.residentk_max_ctx_fitting(*QWEN3_06B, 80 * 2**30) == 65536
    assert rc.residentk_max_ctx_fitting(*QWEN3_06B, 0) == 0
    assert rc.residentk_max_ctx_fitting(*QWEN3_06B, -5) == 0
    assert rc.residentk_max_ctx_fitting(1024, 5, 2, 128, 3072, 28, 151936, 2**40) == 0
    # Splitting 2 ways halves the KV per GPU: a budget that holds 1024 on one GPU holds more.
    b = total_512 + 512 * per_pos
    assert rc.residentk_max_ctx_fitting(*QWEN3_06B, b, tp=2) > 1024


# ---- bytes per weight format -----------------------------------------------------------------
# The reference below is written from the format's definition (f32 4 B, bf16/f16 2 B an element;
# int8 1 B an element + a float32 scale per block of 32 along each row; q4_0 18 B per block of
# 32), in Python's unbounded ints; the pinned numbers beside it were worked out by hand in the
# comments.

FORMATS = ("f32", "bf16", "f16", "int8", "q4_0")
Q8_UNTIED = (4096, 32, 8, 128, 12288, 36, 151936)   # Qwen3-8B: separate lm_head
# Row lengths 1000 (d_model), 40 (h_q * d_head) and 2730 (d_ff; 546 at tp=5) are none of them a
# multiple of 32, so every int8 matrix has a partial last block; vocab is prime.
RAGGED = (1000, 5, 5, 8, 2730, 3, 50261)


def _matrix_bytes_ref(rows, cols, fmt):
    if fmt == "int8":
        return rows * cols + 4 * rows * -(-cols // 32)  # integer ceil: exact past 2**53
    if fmt == "q4_0":
        return 18 * rows * -(-cols // 32)
    return {"f32": 4, "bf16": 2, "f16": 2}[fmt] * rows * cols


def _bytes_reference(d, hq, hkv, dh, ff, n_layers, vocab, ctx, tied=True, tp=1, fmt="f32"):
    """(weight_bytes, total_bytes) per GPU: each weight a (out, in) matrix, rows along its input."""
    hq, hkv, ff = hq // tp, hkv // tp, ff // tp
    m = lambda rows, cols: _matrix_bytes_ref(rows, cols, fmt)  # noqa: E731
    layer = (m(hq * dh, d) + m(hkv * dh, d) + m(hkv * dh, d) + m(d, hq * dh)   # q k v o
             + m(ff, d) + m(ff, d) + m(d, ff))                                 # gate up down
    norms = 4 * (n_layers * (2 * d + 2 * dh) + d)
    weights = n_layers * layer + m(vocab, d) * (1 if tied else 2) + norms
    return weights, weights + 4 * n_layers * 2 * ctx * hkv * dh


def test_weight_format_constants():
    assert rc.RESIDENT_WEIGHT_FORMATS == FORMATS
    assert rc.RESIDENT_INT8_BLOCK == 32
    assert "residentk_matrix_bytes" in rc.__all__ and "RESIDENT_WEIGHT_FORMATS" in rc.__all__


def test_matrix_bytes_by_hand():
    # q4_0: 3 rows of 2 blocks (33 = 32 + 1) at 18 bytes
    assert [rc.residentk_matrix_bytes(3, 33, f) for f in FORMATS] == [396, 198, 198, 123, 108]
    assert rc.residentk_matrix_bytes(3, 33) == 396                 # f32 is the default
    assert rc.residentk_matrix_bytes(1, 1, "int8") == 1 + 4        # one element, one scale
    assert rc.residentk_matrix_bytes(2, 32, "int8") == 64 + 2 * 4  # exactly one block a row
    assert rc.residentk_matrix_bytes(2, 33, "int8") == 66 + 2 * 8  # 33 needs a second block
    assert rc.residentk_matrix_bytes(7, 31, "int8") == 217 + 7 * 4
    # The blocks run along each row (cols), not along the columns: the transpose differs.
    assert rc.residentk_matrix_bytes(33, 3, "int8") == 99 + 33 * 4 != 123
    # Qwen3-0.6B's embedding, 151,936 x 1,024: 32 blocks a row.
    assert rc.residentk_matrix_bytes(151936, 1024, "int8") == 151936 * (1024 + 32 * 4)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows,cols", [(1, 1), (1, 31), (5, 32), (5, 33), (64, 1000),
                                       (151936, 1024), (1024, 3072), (1000, 2730)])
def test_matrix_bytes_matches_reference(rows, cols, fmt):
    assert rc.residentk_matrix_bytes(rows, cols, fmt) == _matrix_bytes_ref(rows, cols, fmt)


def test_matrix_bytes_empty_and_overflow_are_zero():
    for fmt in FORMATS:
        for rows, cols in [(0, 5), (5, 0), (-1, 5), (5, -(2**70)), (2**70, 1), (2**62, 4),
                           (2**63 - 1, 2**63 - 1)]:
            assert rc.residentk_matrix_bytes(rows, cols, fmt) == 0
    # Just below and at 2**63: exact, then refused rather than wrapped.
    assert rc.residentk_matrix_bytes(2**60, 1, "int8") == 5 * 2**60
    assert rc.residentk_matrix_bytes(2**61, 1, "int8") == 0            # 5 * 2**61 > int64
    assert rc.residentk_matrix_bytes(2**59, 7, "bf16") == 7 * 2**60    # < 2**63
    assert rc.residentk_matrix_bytes(2**59, 7, "f32") == 0             # 7 * 2**61 > int64


def test_footprint_bytes_qwen3_06b_by_hand():
    # 595,984,384 matrix elements (596,049,920 weights less 65,536 norm elements); every Qwen3-0.6B
    # row length (1,024, 2,048, 3,072) is a multiple of 32, so int8 costs 1 + 4/32 bytes an
    # element. KV at 512 positions: 29,360,128 float32 = 117,440,512 bytes.
    want = {"f32": (2_384_199_680, 2_501_640_192),                  # 4 x the element counts
            "bf16": (595_984_384 * 2 + 262_144, 1_309_671_424),     # 1,192,230,912 weights
            "f16": (1_192_230_912, 1_309_671_424),
            "int8": (595_984_384 * 9 // 8 + 262_144, 788_185_088)}  # 670,744,576 weights
    for fmt, (wb, tb) in want.items():
        f = rc.residentk_footprint(*QWEN3_06B, format=fmt)
        assert (f["weight_bytes"], f["total_bytes"]) == (wb, tb) == _bytes_reference(*QWEN3_06B, 512, fmt=fmt)
        # Element counts do not depend on the format.
        assert f["weights"] == 596_049_920 and f["total"] == 625_410_048
        assert f["total_bytes"] - f["weight_bytes"] == 4 * f["kv_cache"]


def test_footprint_bytes_tiny_shape_by_hand():
    # D 40, Hq 2, Hkv 1, Dh 4, F 50, 1 layer, V 3, ctx 1, int8 (bytes + 4 a block of 32 a row):
    #   q (8, 40) 320 + 8*2*4 = 384; k, v (4, 40) 192 each; o (40, 8) 320 + 40*1*4 = 480;
    #   gate, up (50, 40) 2,000 + 50*2*4 = 2,400 each; down (40, 50) 2,000 + 40*2*4 = 2,320
    #   layer 8,368; embedding (3, 40) 120 + 3*2*4 = 144; norms (2*40 + 2*4) + 40 = 128 float32
    #   = 512 bytes; weights 9,024; KV 1 * 2 * 1 * 1 * 4 = 8 float32 = 32 bytes; total 9,056.
    f = rc.residentk_footprint(40, 2, 1, 4, 50, 1, 3, 1, format="int8")
    assert f["status"] == 600 and (f["weight_bytes"], f["total_bytes"]) == (9_024, 9_056)
    # Untied: a second (3, 40) matrix.
    f = rc.residentk_footprint(40, 2, 1, 4, 50, 1, 3, 1, tied=False, format="int8")
    assert (f["weight_bytes"], f["total_bytes"]) == (9_168, 9_200)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape,ctx,tied,tp", [
    (QWEN3_06B, 512, True, 1), (QWEN3_06B, 3000, True, 2), (QWEN3_06B, 65536, False, 8),
    (Q8_UNTIED, 4096, False, 1), (Q8_UNTIED, 8192, False, 2), (Q8_UNTIED, 1, False, 4),
    (RAGGED, 1, True, 1), (RAGGED, 777, False, 1), (RAGGED, 65536, True, 5),
])
def test_footprint_bytes_match_reference(shape, ctx, tied, tp, fmt):
    f = rc.residentk_footprint(*shape, ctx, tied=tied, tp=tp, format=fmt)
    assert f["status"] == 600
    assert (f["weight_bytes"], f["total_bytes"]) == _bytes_reference(*shape, ctx, tied, tp, fmt)
    # The float32 element counts are the format-free ones.
    g = rc.residentk_footprint(*shape, ctx, tied=tied, tp=tp)
    assert {k: f[k] for k in g if not k.endswith("_bytes")} == {k: g[k] for k in g
                                                               if not k.endswith("_bytes")}


def test_footprint_bytes_ragged_rows_pay_the_partial_block():
    # RAGGED at int8: every matrix pays ceil(cols / 32) scales a row, not cols / 32 (floor would
    # drop a block from every row; exact division would not be an integer).
    d, hq, hkv, dh, ff, n_layers, vocab = RAGGED
    f = rc.residentk_footprint(*RAGGED, 1, format="int8")
    floor_blocks = (n_layers * ((hq * dh + 2 * hkv * dh + 2 * ff) * (d // 32) + d * (hq * dh // 32)
                                + d * (ff // 32)) + vocab * (d // 32))
    ceil_blocks = (n_layers * ((hq * dh + 2 * hkv * dh + 2 * ff) * 32 + d * 2 + d * 86)
                   + vocab * 32)   # ceil(1000/32) = 32, ceil(40/32) = 2, ceil(2730/32) = 86
    elems = f["weights"] - f["norms"]
    assert f["weight_bytes"] == elems + 4 * ceil_blocks + 4 * f["norms"]
    assert f["weight_bytes"] > elems + 4 * floor_blocks + 4 * f["norms"]
    # At tp=5 the down projection's rows are 546 long: ceil(546/32) = 18 blocks, not 17.
    g = rc.residentk_footprint(*RAGGED, 1, tp=5, format="int8")
    assert g["weight_bytes"] == _bytes_reference(*RAGGED, 1, tp=5, fmt="int8")[0]
    assert rc.residentk_matrix_bytes(d, ff // 5, "int8") == d * 546 + 4 * d * 18


def test_footprint_f32_bytes_are_four_times_the_elements():
    for shape, tied in [(QWEN3_06B, True), (QWEN3_06B, False), (Q8_UNTIED, False), (RAGGED, True)]:
        for ctx in (1, 512, 3000, 65536):
            for tp in (1, 2, 4, 5):
                f = rc.residentk_footprint(*shape, ctx, tied=tied, tp=tp)
                if f["status"] != 600:
                    assert tp > 1 and f["weight_bytes"] == f["total_bytes"] == 0
                    continue
                assert f["weight_bytes"] == 4 * f["weights"] and f["total_bytes"] == 4 * f["total"]
    assert rc.residentk_footprint(*QWEN3_06B)["total_bytes"] == 4 * rc.residentk_weight_elems(*QWEN3_06B)


def test_footprint_bytes_zero_when_refused():
    for fmt in FORMATS:
        for args, kw in [((1024, 5, 2, 128, 3072, 28, 151936), {}), (QWEN3_06B + (0,), {}),
                         (QWEN3_06B + (70000,), {}), (QWEN3_06B, {"tp": 3})]:
            f = rc.residentk_footprint(*args, **kw, format=fmt)
            assert f["status"] != 600 and f["weight_bytes"] == f["total_bytes"] == 0


def test_footprint_bytes_shrink_with_the_format():
    for shape, tp in [(QWEN3_06B, 1), (Q8_UNTIED, 2), (RAGGED, 5)]:
        b = {fmt: rc.residentk_footprint(*shape, 4096, tp=tp, format=fmt) for fmt in FORMATS}
        assert b["bf16"]["total_bytes"] == b["f16"]["total_bytes"]
        assert b["f32"]["weight_bytes"] > b["bf16"]["weight_bytes"] > b["int8"]["weight_bytes"]
        # bf16 halves every matrix exactly; the float32 norms do not shrink.
        norms = 4 * b["f32"]["norms"]
        assert b["f32"]["weight_bytes"] - norms == 2 * (b["bf16"]["weight_bytes"] - norms)


def test_max_ctx_fitting_grows_as_the_format_shrinks():
    per_pos = 28 * 2 * 8 * 128 * 4

    def largest(fmt, budget, shape=QWEN3_06B, tied=True, tp=1):  # by the reference, bucket by bucket
        fits = [c for c in (2**k for k in range(9, 17))
                if _bytes_reference(*shape, c, tied, tp, fmt)[1] <= budget]
        return max(fits, default=0)

    # 2.5 GiB: after the weights, f32 leaves room for 1,308 positions, bf16 6,505, int8 8,778.
    budget = 5 * 2**29
    got = {fmt: rc.residentk_max_ctx_fitting(*QWEN3_06B, budget, format=fmt) for fmt in FORMATS}
    assert got == {fmt: largest(fmt, budget) for fmt in FORMATS}
    assert got == {"f32": 1024, "bf16": 4096, "f16": 4096, "int8": 8192, "q4_0": 8192}
    # Exactly the int8 footprint at 512 positions: int8 fits, f32 does not; one byte less, none.
    int8_512 = 788_185_088
    assert rc.residentk_max_ctx_fitting(*QWEN3_06B, int8_512, format="int8") == 512
    assert rc.residentk_max_ctx_fitting(*QWEN3_06B, int8_512 - 1, format="int8") == 0
    assert rc.residentk_max_ctx_fitting(*QWEN3_06B, int8_512) == 0
    assert rc.residentk_max_ctx_fitting(*QWEN3_06B, int8_512 + 512 * per_pos, format="int8") == 1024
    # f32 keeps its old answer: 4 bytes an element, the seed's numbers.
    assert rc.residentk_max_ctx_fitting(*QWEN3_06B, 625_410_048 * 4, format="f32") == 512
    # Untied, split over GPUs, ragged rows.
    for shape, tied, tp, budget in [(Q8_UNTIED, False, 1, 24 * 2**30), (Q8_UNTIED, False, 2, 10**10),
                                    (RAGGED, True, 5, 10**8)]:
        caps = [rc.residentk_max_ctx_fitting(*shape, budget, tied=tied, tp=tp, format=fmt)
                for fmt in ("f32", "bf16", "int8")]
        assert caps == [largest(fmt, budget, shape, tied, tp) for fmt in ("f32", "bf16", "int8")]
        assert caps[0] <= caps[1] <= caps[2] and caps[0] < caps[2]


@pytest.mark.parametrize("bad", ["fp8", "", "int4", "float32", "f32 ", "bfloat16", "q8_0"])
def test_unknown_format_name_is_refused(bad):
    calls = [lambda: rc.residentk_matrix_bytes(4, 4, bad),
             lambda: rc.residentk_footprint(*QWEN3_06B, format=bad),
             lambda: rc.residentk_max_ctx_fitting(*QWEN3_06B, 2**33, format=bad),
             # the name is refused before any number is looked at
             lambda: rc.residentk_matrix_bytes(0, -1, bad),
             lambda: rc.residentk_footprint(0, 0, 0, 0, 0, 0, 0, format=bad)]
    for call in calls:
        with pytest.raises(algenta.ResidentError) as e:
            call()
        assert isinstance(e.value, ValueError) and e.value.status == 601
        assert all(f"'{f}'" in str(e.value) for f in FORMATS) and repr(bad) in str(e.value)


@pytest.mark.parametrize("bad", [None, 4, b"f32", ["f32"], 32.0])
def test_format_of_the_wrong_type_is_a_type_error(bad):
    with pytest.raises(TypeError):
        rc.residentk_matrix_bytes(4, 4, bad)
    with pytest.raises(TypeError):
        rc.residentk_footprint(*QWEN3_06B, format=bad)
    with pytest.raises(TypeError):
        rc.residentk_max_ctx_fitting(*QWEN3_06B, 2**33, format=bad)


def test_runtime_dispatches_matrix_bytes():
    rt = algenta.MojoRuntime(mode="local")
    assert rt.execute("residentk.contract", "residentk_matrix_bytes", [3, 33, "int8"]) == {
        "result": 123, "status": 600}
    out = rt.execute("residentk.contract", "residentk_matrix_bytes", [3, 33, "fp8"])
    assert out["status"] == 601 and "'int8'" in out["error"] and out["result"] is None


def test_scalars_ok():
    assert rc.residentk_scalars_ok(1e-6, 1 / math.sqrt(128))
    assert rc.residentk_scalars_ok(1, 1)
    for eps, scale in [(0.0, 1.0), (1e-6, 0.0), (-1e-6, 1.0), (1e-6, -0.1), (math.nan, 1.0),
                       (1e-6, math.inf), (math.inf, 1.0), (1e-6, -math.inf)]:
        assert not rc.residentk_scalars_ok(eps, scale)
    with pytest.raises(TypeError):
        rc.residentk_scalars_ok("1e-6", 1.0)


def test_bucket_ctx():
    assert rc.resident_bucket_ctx(1) == 512
    assert rc.resident_bucket_ctx(0) == 512
    assert rc.resident_bucket_ctx(-7) == 512
    assert rc.resident_bucket_ctx(512) == 512
    assert rc.resident_bucket_ctx(513) == 1024
    assert rc.resident_bucket_ctx(1024) == 1024
    assert rc.resident_bucket_ctx(3000) == 4096
    assert rc.resident_bucket_ctx(65535) == 65536
    assert rc.resident_bucket_ctx(65536) == 65536
    assert rc.resident_bucket_ctx(10**6) == 65536
    assert rc.resident_bucket_ctx(2**100) == 65536
    for n in range(1, 70000, 977):
        b = rc.resident_bucket_ctx(n)
        assert b >= min(n, 65536) and b & (b - 1) == 0 and 512 <= b <= 65536
        assert b == 512 or b // 2 < n


def test_splitk_and_prefill_smoke():
    # Pinned in their own suites; here: the contract module exposes them with the seed's names.
    assert rc.residentk_splitk_should_split(32) and not rc.residentk_splitk_should_split(31)
    assert rc.residentk_splitk_policy(128, 40, 16) == 40
    assert rc.residentk_splitk_max_n_splits(40, 16) == 80
    assert rc.residentk_prefill_gemm_use_narrow_tile(5)


def test_runtime_dispatches_contract():
    rt = algenta.MojoRuntime(mode="local")
    assert rt.execute("residentk.contract", "residentk_dispatch_budget", [28]) == {"result": 171, "status": 600}
    out = rt.execute("residentk.contract", "residentk_weight_elems", list(QWEN3_06B))
    assert out == {"result": 625_410_048, "status": 600}
    assert rt.execute("residentk.contract", "residentk_cache_elements", [28, 8, 128, 512])["result"] == 29_360_128
    assert rt.execute("residentk.contract", "residentk_status_name", [604])["result"] == "resident_shader_toolchain_absent"
    with pytest.raises(ValueError):
        rt.execute("residentk.contract", "_shape", [1, 2, 3, 4, 5])


# ---- properties over arbitrary integers ------------------------------------------------------

from hypothesis import given, settings, strategies as st  # noqa: E402

_any_int = st.one_of(st.integers(-(2**70), 2**70), st.integers(-3, 70000),
                     st.sampled_from([0, 1, 2**31, 2**63 - 1, 2**63, -(2**63)]))
_dim = st.one_of(st.integers(1, 4096), st.sampled_from([1, 2, 8, 64, 128, 65536, 65537]))


@settings(max_examples=300, deadline=None)
@given(d=_dim, hq=st.integers(1, 64), hkv=st.integers(1, 64),
       dh=st.sampled_from([1, 2, 4, 16, 64, 96, 128, 256, 1024, 2048]), ff=_dim,
       n_layers=st.integers(1, 1100), vocab=st.integers(1, 5_000_000), ctx=st.integers(-2, 70000),
       tied=st.booleans())
def test_weight_elems_is_reference_or_zero(d, hq, hkv, dh, ff, n_layers, vocab, ctx, tied):
    got = rc.residentk_weight_elems(d, hq, hkv, dh, ff, n_layers, vocab, ctx, tied=tied)
    ok = (rc.residentk_shape_check(d, hq, hkv, dh, ff, n_layers, vocab) == 600
          and 1 <= ctx <= 65536)
    assert got == (_weights_reference(d, hq, hkv, dh, ff, n_layers, vocab, ctx, tied) if ok else 0)


@settings(max_examples=300, deadline=None)
@given(args=st.lists(_any_int, min_size=7, max_size=7), ctx=_any_int)
def test_no_integer_crashes_or_wraps(args, ctx):
    st_ = rc.residentk_shape_check(*args)
    assert st_ in (600, 601, 602, 603)
    assert rc.residentk_dims_check(*args[:5]) in (600, 601, 602, 603)
    w = rc.residentk_weight_elems(*args, ctx)
    assert w >= 0 and (w == 0 or st_ == 600)
    assert rc.residentk_context_check(args[0], args[1], ctx) in (600, 601, 602, 606)
    assert rc.residentk_cache_elements(args[5], args[2], args[3], ctx) >= 0
    assert rc.residentk_dispatch_budget(args[5]) >= 0
    assert 1 <= rc.residentk_splitk_policy(args[0], args[1], args[2]) <= 256
    assert rc.resident_bucket_ctx(ctx) in {2**k for k in range(9, 17)}
    assert rc.residentk_max_ctx_fitting(*args, ctx) in {0} | {2**k for k in range(9, 17)}


@settings(max_examples=300, deadline=None)
@given(n_prompt=_any_int, n_new=_any_int, max_ctx=_any_int)
def test_context_check_matches_exact_arithmetic(n_prompt, n_new, max_ctx):
    clamp = lambda v: min(max(v, -(2**63)), 2**63 - 1)  # noqa: E731  (the wrapper's int64 clamp)
    p, n, c = clamp(n_prompt), clamp(n_new), clamp(max_ctx)
    if p < 1 or n < 0 or c < 1:
        want = 601
    elif c > 65536:
        want = 602
    else:
        want = 606 if p + n > c else 600
    assert rc.residentk_context_check(n_prompt, n_new, max_ctx) == want


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(d=_dim, kv=st.integers(0, 4), group=st.integers(0, 3), dh=st.sampled_from([1, 2, 4, 8, 64, 128]),
       ff=_dim, n_layers=st.integers(1, 1100), vocab=st.integers(1, 5_000_000),
       ctx=st.integers(-2, 70000), tied=st.booleans(), tp=st.sampled_from([1, 2, 3, 4]),
       fmt=st.sampled_from(FORMATS))
def test_footprint_bytes_are_reference_or_zero(d, kv, group, dh, ff, n_layers, vocab, ctx, tied,
                                               tp, fmt):
    hkv = 2**kv
    hq = hkv * 2**group
    f = rc.residentk_footprint(d, hq, hkv, dh, ff, n_layers, vocab, ctx, tied=tied, tp=tp,
                               format=fmt)
    ok = (rc.residentk_shape_check(d, hq, hkv, dh, ff, n_layers, vocab) == 600
          and 1 <= ctx <= 65536 and hq % tp == hkv % tp == ff % tp == 0)
    want = _bytes_reference(d, hq, hkv, dh, ff, n_layers, vocab, ctx, tied, tp, fmt) if ok else (0, 0)
    assert (f["weight_bytes"], f["total_bytes"]) == want
    assert f["status"] == 600 or not ok


@settings(max_examples=200, deadline=None)
@given(rows=_any_int, cols=_any_int, fmt=st.sampled_from(FORMATS))
def test_matrix_bytes_any_integer_is_exact_or_zero(rows, cols, fmt):
    r, c = min(max(rows, -(2**63)), 2**63 - 1), min(max(cols, -(2**63)), 2**63 - 1)
    want = _matrix_bytes_ref(r, c, fmt) if r >= 1 and c >= 1 else 0
    assert rc.residentk_matrix_bytes(rows, cols, fmt) == (want if want < 2**63 else 0)
