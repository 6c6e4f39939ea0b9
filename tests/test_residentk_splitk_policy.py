"""The split-K attention policy: the calibrated anchors pinned exactly, and its shape everywhere.

Formula (residentk.contract docstring): M = clamp(ceil(32 * n_cores / h_q), 1, 256), 80 when
n_cores <= 0; policy = 1 below 32 keys, else
clamp(round(M/2 * (1 + ln(n_keys/128) / ln(1000/128))), 1, M).
"""

import math

import pytest

from algenta.residentk.contract import (
    RESIDENT_SPLITK_MAX_SPLITS,
    residentk_splitk_max_n_splits,
    residentk_splitk_policy,
    residentk_splitk_should_split,
)


def test_calibrated_anchors_exact():
    assert residentk_splitk_policy(128, 40, 16) == 40
    assert residentk_splitk_policy(1000, 40, 16) == 80
    assert residentk_splitk_max_n_splits(40, 16) == 80


def test_unprobeable_core_count_is_last_known_good_80():
    for n_cores in (0, -1, -(2**63), -(2**80)):
        assert residentk_splitk_max_n_splits(n_cores, 16) == 80
        assert residentk_splitk_max_n_splits(n_cores, 64) == 80
        assert residentk_splitk_policy(1000, n_cores, 16) == 80
        assert residentk_splitk_policy(128, n_cores, 16) == 40


def test_should_split_boundary():
    assert not residentk_splitk_should_split(31)
    assert residentk_splitk_should_split(32)
    assert not residentk_splitk_should_split(0)
    assert not residentk_splitk_should_split(-5)
    assert residentk_splitk_should_split(2**70)


def test_one_split_below_32_keys():
    for n in (-(2**70), -1, 0, 1, 16, 31):
        assert residentk_splitk_policy(n, 40, 16) == 1
        assert residentk_splitk_policy(n, 132, 1) == 1


def _reference(n_keys, n_cores, h_q):
    """The documented formula in Python floats, independent of the C++."""
    if n_keys < 32:
        return 1
    m = 80 if n_cores <= 0 else min(max(-(-32 * n_cores // h_q), 1), 256)
    x = math.floor(m / 2 + m / 2 * (math.log(n_keys / 128) / math.log(1000 / 128)) + 0.5)
    return min(max(x, 1), m)


@pytest.mark.parametrize("n_cores,h_q", [(40, 16), (132, 64), (108, 32), (8, 16), (0, 16),
                                         (1, 128), (400, 1)])
def test_matches_documented_formula(n_cores, h_q):
    for n in [32, 33, 50, 64, 100, 127, 128, 129, 255, 256, 500, 999, 1000, 1001, 4096, 65536]:
        assert residentk_splitk_policy(n, n_cores, h_q) == _reference(n, n_cores, h_q), n


def test_reference_gpu_values_between_anchors():
    got = [residentk_splitk_policy(n, 40, 16) for n in (32, 64, 128, 256, 512, 1000)]
    assert got == [13, 27, 40, 53, 67, 80]


@pytest.mark.parametrize("n_cores,h_q", [(40, 16), (132, 64), (108, 32), (1, 1), (-1, 8),
                                         (16, 40), (10**6, 1), (2**63 - 1, 2)])
def test_monotone_and_clamped(n_cores, h_q):
    cap = residentk_splitk_max_n_splits(n_cores, h_q)
    assert 1 <= cap <= RESIDENT_SPLITK_MAX_SPLITS
    prev = 0
    for n in list(range(0, 2100)) + [2**k for k in range(12, 63)] + [2**63 - 1]:
        p = residentk_splitk_policy(n, n_cores, h_q)
        assert 1 <= p <= cap
        assert p >= prev, (n, p, prev)
        prev = p
    assert prev == cap  # deep enough, every GPU saturates its own ceiling


def test_max_n_splits_scales_with_cores_and_heads():
    assert residentk_splitk_max_n_splits(80, 16) == 160          # twice the SMs, twice the splits
    assert residentk_splitk_max_n_splits(40, 32) == 40           # twice the heads, half
    assert residentk_splitk_max_n_splits(40, 48) == 27           # ceil(1280 / 48)
    assert residentk_splitk_max_n_splits(132, 64) == 66          # H100: ceil(4224 / 64)
    assert residentk_splitk_max_n_splits(1, 1024) == 1           # more heads than block slots
    assert residentk_splitk_max_n_splits(132, 1) == 256          # capped
    assert residentk_splitk_max_n_splits(2**63 - 1, 1) == 256
    assert residentk_splitk_max_n_splits(2**90, 3) == 256
    assert residentk_splitk_max_n_splits(40, 0) == 1             # no heads: nothing to split
    assert residentk_splitk_max_n_splits(40, -16) == 1


def test_policy_other_hardware_keeps_the_fraction():
    # Half the ceiling at 128 keys and all of it at 1000, whatever the ceiling is.
    for n_cores, h_q in [(132, 64), (108, 32), (80, 16)]:
        m = residentk_splitk_max_n_splits(n_cores, h_q)
        assert residentk_splitk_policy(128, n_cores, h_q) == math.floor(m / 2 + 0.5)
        assert residentk_splitk_policy(1000, n_cores, h_q) == m


def test_types():
    with pytest.raises(TypeError):
        residentk_splitk_policy(128.0, 40, 16)
    with pytest.raises(TypeError):
        residentk_splitk_max_n_splits(40, None)
