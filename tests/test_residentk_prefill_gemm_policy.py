"""The prefill GEMM tile policy: narrow below 32 rows, pinned at its two measured anchors."""

import pytest

from algenta.residentk.contract import (
    RESIDENT_PREFILL_NARROW_BELOW_ROWS,
    residentk_prefill_gemm_use_narrow_tile,
)


def test_measured_anchors():
    # narrow measured faster at 5 rows (110.1 vs 91.6 tok/s); wide at 256 (1165 vs 783.3 tok/s)
    assert residentk_prefill_gemm_use_narrow_tile(5) is True
    assert residentk_prefill_gemm_use_narrow_tile(256) is False


def test_boundary_is_32_rows():
    assert RESIDENT_PREFILL_NARROW_BELOW_ROWS == 32
    assert residentk_prefill_gemm_use_narrow_tile(31) is True
    assert residentk_prefill_gemm_use_narrow_tile(32) is False


def test_a_single_switch_point():
    flags = [residentk_prefill_gemm_use_narrow_tile(m) for m in range(1, 4097)]
    assert flags == [True] * 31 + [False] * (4096 - 31)


@pytest.mark.parametrize("m", [2**40, 2**63 - 1, 2**64, 10**30])
def test_huge_row_counts_are_wide(m):
    assert residentk_prefill_gemm_use_narrow_tile(m) is False


def test_types():
    with pytest.raises(TypeError):
        residentk_prefill_gemm_use_narrow_tile(5.0)
    with pytest.raises(TypeError):
        residentk_prefill_gemm_use_narrow_tile("5")
