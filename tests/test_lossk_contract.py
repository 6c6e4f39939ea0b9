"""lossk.contract: the status vocabulary, ceilings and budget checks (the seed's suite)."""

import math

import pytest

import algenta
from algenta.lossk import contract as C

CODES = {
    580: "ok", 581: "empty_dimension", 582: "length_mismatch", 583: "dimension_too_large",
    584: "work_budget_exceeded", 585: "non_finite_scalar", 586: "target_id_out_of_range",
    587: "chunk_exceeds_logit_budget", 588: "unknown_objective", 589: "no_cuda_backend",
    590: "no_cuda_device", 591: "cuda_call_failed",
}


def test_status_names_cover_the_range():
    for code, name in CODES.items():
        assert C.loss_status_name(code) == name
    for code in (579, 592, 599, 600, -1, 0, 2**62, -(2**70), 2**80):
        assert C.loss_status_name(code) == "unknown_status"


def test_constants():
    assert C.LOSS_OK == 580 and C.LOSS_ERR_UNKNOWN_OBJECTIVE == 588
    assert [C.LOSS_ERR_EMPTY_DIMENSION, C.LOSS_ERR_LENGTH_MISMATCH, C.LOSS_ERR_DIMENSION_TOO_LARGE,
            C.LOSS_ERR_WORK_BUDGET, C.LOSS_ERR_NON_FINITE, C.LOSS_ERR_TARGET_OUT_OF_RANGE,
            C.LOSS_ERR_BAD_CHUNK] == list(range(581, 588))
    assert [C.LOSS_ERR_NO_CUDA_BACKEND, C.LOSS_ERR_NO_DEVICE,
            C.LOSS_ERR_DEVICE_FAILED] == [589, 590, 591]
    assert C.LOSS_MAX_WORK_CELLS == 2**46
    assert C.LOSS_MAX_LOGIT_CELLS == 2**27
    assert C.LOSS_TRANSCENDENTAL_FLOOR == 1e-9
    # ceilings admit real vocabularies and widths
    assert C.LOSS_MAX_VOCAB >= 262144 and C.LOSS_MAX_D_MODEL >= 16384


def test_dims_check_seed_examples():
    assert C.loss_dims_check(2048, 4096, 151936) == 580  # Qwen3-8B-scale step: legal
    assert C.loss_dims_check(0, 4, 4) == 581
    assert C.loss_dims_check(4, -1, 4) == 581
    assert C.loss_dims_check(4, 4, 0) == 581
    assert C.loss_dims_check(C.LOSS_MAX_TOKENS + 1, 1, 1) == 583
    assert C.loss_dims_check(1, C.LOSS_MAX_D_MODEL + 1, 1) == 583
    assert C.loss_dims_check(1, 1, C.LOSS_MAX_VOCAB + 1) == 583
    assert C.loss_dims_check(2**62, 2**62, 2**62) == 583
    assert C.loss_dims_check(2**200, 1, 1) == 583  # beyond int64: refused, not wrapped
    # 2^46 work cells exactly fits; one more token does not
    assert C.loss_dims_check(2**12, 2**12, 2**22) == 580
    assert C.loss_dims_check(2**12 + 1, 2**12, 2**22) == 584


def test_chunk_check_seed_examples():
    assert C.loss_chunk_check(2048, 151936) == 587  # batch size where a chunk belongs
    assert C.loss_chunk_check(256, 151936) == 580
    assert C.loss_chunk_check(0, 10) == 581 and C.loss_chunk_check(10, 0) == 581
    assert C.loss_chunk_check(2**26, 1) == 580 and C.loss_chunk_check(2**26 + 1, 1) == 583
    assert C.loss_chunk_check(2**25, 4) == 580 and C.loss_chunk_check(2**25 + 1, 4) == 587
    assert C.loss_chunk_check(2**27 // 151936, 151936) == 580
    assert C.loss_chunk_check(2**27 // 151936 + 1, 151936) == 587


def test_logit_cells():
    assert C.loss_logit_cells(256, 151936) == 38895616.0
    assert isinstance(C.loss_logit_cells(1, 1), float)
    for bad in ((0, 5), (5, 0), (-3, 5), (2**63 - 1, 2**63 - 1), (2**90, 2)):
        assert C.loss_logit_cells(*bad) < 0


def test_work_fits_divides_exactly_at_the_boundary():
    assert C.loss_work_fits(2, 3, 5, 30) and not C.loss_work_fits(2, 3, 5, 29)
    assert C.loss_work_fits(2**20, 2**20, 2**20, 2**60)
    assert not C.loss_work_fits(2**21, 2**21, 2**21, 2**62)  # product 2^63 would overflow int64
    assert not C.loss_work_fits(0, 1, 1, 10) and not C.loss_work_fits(1, 1, 1, 0)
    big = 2**63 - 1
    assert C.loss_work_fits(1, 1, big, big) and not C.loss_work_fits(2, 1, big, big)


def test_targets_in_range():
    assert C.loss_targets_in_range([0, 3, 8], 3, 9)
    assert not C.loss_targets_in_range([0, 9], 2, 9)
    assert not C.loss_targets_in_range([0, -1], 2, 9)  # negative is never a mask here
    assert C.loss_targets_in_range([0, 1, -5], 2, 9)  # only the first n_tok are read
    assert not C.loss_targets_in_range([0], 2, 9)  # shorter than n_tok
    assert C.loss_targets_in_range([], 0, 9)


def test_scalars_ok():
    assert C.loss_scalars_ok(0.0) and C.loss_scalars_ok(-1e308) and C.loss_scalars_ok(3)
    for bad in (math.nan, math.inf, -math.inf):
        assert not C.loss_scalars_ok(bad)
    with pytest.raises(TypeError):
        C.loss_scalars_ok("1.0")


def test_tol_for_grows_with_magnitude_and_width():
    base = C.loss_tol_for(1.0, 1)
    assert base > 0
    assert C.loss_tol_for(10.0, 1) > base and C.loss_tol_for(1.0, 1024) > base
    assert C.loss_tol_for(-10.0, 1) == C.loss_tol_for(10.0, 1)
    assert C.loss_tol_for(0.0, 1) == base  # magnitudes below 1 count as 1
    assert math.isnan(C.loss_tol_for(math.nan, 4))


def test_max_chunk():
    assert C.loss_max_chunk(2048, 151936) == 2**27 // 151936
    assert C.loss_max_chunk(7, 9) == 7
    assert C.loss_max_chunk(0, 9) == 0 and C.loss_max_chunk(9, 0) == 0


def test_wrong_types_are_type_errors():
    with pytest.raises(TypeError):
        C.loss_dims_check(1.5, 2, 3)
    with pytest.raises(TypeError):
        C.loss_chunk_check(True, 3)


@pytest.mark.smoke
def test_through_runtime():
    rt = algenta.MojoRuntime(mode="local")
    assert rt.execute("lossk.contract", "loss_dims_check", [2048, 4096, 151936]) == {"result": 580, "status": 580}
    assert rt.execute("lossk.contract", "loss_chunk_check", [2048, 151936])["result"] == 587
    assert rt.execute("lossk.contract", "loss_status_name", [9999])["result"] == "unknown_status"
