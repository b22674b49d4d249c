"""edgeflux.neuroflux.partition: Algorithm 1 on hand-computed cases and against a brute-force reference."""
from __future__ import annotations

import random

import pytest

from edgeflux.memory import BudgetTooSmallError
from edgeflux.neuroflux.partition import (UNBOUNDED, Block, UnitDoesNotFitError, group, load_blocks, max_batch_for,
                                          min_budget_bytes, partition, save_blocks, unit_batch_sizes)


def blocks_of(sizes, rho=0.4):
    return [(b.units, b.batch_size) for b in group(sizes, rho)]


def models_for(sizes, a=1000, budget=1_000_000):
    """(a, b) per unit whose max batch under `budget` is exactly sizes[i]: a*s + b == budget."""
    return [(a, budget - a * s) for s in sizes]


# ----------------------------------------------------------------------------- grouping (lines 6-17)

def test_hand_computed_example():
    # |13-10|=3 <= 4; |18-13|=5 <= 5.2; |30-18|=12 > 7.2 -> new block; |31-30|=1 <= 12; |100-31|=69 > 12.4
    assert blocks_of([10, 13, 18, 30, 31, 100]) == [((0, 1, 2), 10), ((3, 4), 30), ((5,), 100)]


def test_comparison_is_with_the_unit_before_not_the_block_start():
    # each step grows 30% (within 40% of the unit before) although 10 -> 37 is far beyond 40% of 10
    sizes = [10, 13, 16, 20, 26, 33, 37]
    assert blocks_of(sizes) == [(tuple(range(7)), 10)]


def test_threshold_is_relative_to_the_earlier_unit():
    assert blocks_of([100, 60]) == [((0, 1), 60)]        # |60-100| = 40 <= 0.4*100
    assert blocks_of([100, 59]) == [((0,), 100), ((1,), 59)]
    assert blocks_of([60, 100]) == [((0,), 60), ((1,), 100)]   # 40 > 0.4*60 = 24
    assert blocks_of([10, 14]) == [((0, 1), 10)]         # exactly 40% is inside (rho read as decimal 0.4)
    assert blocks_of([10, 15]) == [((0,), 10), ((1,), 15)]


def test_single_unit_blocks_and_rho_zero():
    assert blocks_of([5, 50, 5]) == [((0,), 5), ((1,), 50), ((2,), 5)]
    assert blocks_of([7, 7, 8, 8], rho=0) == [((0, 1), 7), ((2, 3), 8)]


def test_block_indices_are_consecutive():
    blocks = group([1, 100, 100, 3, 3, 3])
    assert [b.index for b in blocks] == [0, 1, 2]
    assert all(isinstance(b, Block) for b in blocks)


def test_batch_limit_merges_units_that_hit_the_cap():
    sizes = [20, 300, 900, 5000]
    models = models_for(sizes, budget=10_000_000)
    assert unit_batch_sizes(models, 10_000_000, 256) == [20, 256, 256, 256]
    blocks = partition(models, 10_000_000, batch_limit=256)
    assert [(b.units, b.batch_size) for b in blocks] == [((0,), 20), ((1, 2, 3), 256)]
    # without the cap the later units would be three blocks
    assert len(partition(models, 10_000_000, batch_limit=10**9)) == 4


def test_partition_uses_the_linear_models():
    budget = 1_000_000
    blocks = partition(models_for([10, 13, 18, 30, 31, 100], budget=budget), budget, batch_limit=512)
    assert [(b.units, b.batch_size) for b in blocks] == [((0, 1, 2), 10), ((3, 4), 30), ((5,), 100)]


# ----------------------------------------------------------------------------- max batch (lines 2-4)

def test_max_batch_exact_at_the_boundary():
    a, b = 1234.0, 56789.0
    for t in (1, 2, 17, 1000):
        budget = a * t + b
        assert max_batch_for(a, b, budget) == t            # lands exactly on the budget: fits
        assert max_batch_for(a, b, budget - 1) == t - 1    # one byte less: batch t does not fit
        assert max_batch_for(a, b, budget + a - 1) == t    # one byte short of t+1
        assert max_batch_for(a, b, budget + a) == t + 1


def test_max_batch_fractional_fit():
    # a fitted line has fractional coefficients: 0.5*t + 0.25 <= 10 -> t <= 19.5
    assert max_batch_for(0.5, 0.25, 10) == 19
    assert max_batch_for(2.5, 0.5, 8.0) == 3            # 2.5*3 + 0.5 == 8.0 exactly
    assert max_batch_for(2.5, 0.5, 7.999) == 2


def test_max_batch_zero_and_unbounded():
    assert max_batch_for(100, 950, 1000) == 0        # batch 1 needs 1050
    assert max_batch_for(100, 900, 1000) == 1
    assert max_batch_for(0, 500, 1000) == UNBOUNDED  # flat: every batch fits
    assert max_batch_for(0, 1500, 1000) == 0
    assert max_batch_for(-5, 800, 1000) == UNBOUNDED
    assert unit_batch_sizes([(0, 500)], 1000, batch_limit=64) == [64]


def test_unit_that_cannot_fit_batch_1_names_itself_and_the_smallest_budget():
    models = [(1000, 5000), (4000, 9000.5), (10, 20)]   # batch 1: 6000, 13000.5, 30 bytes
    with pytest.raises(UnitDoesNotFitError) as info:
        partition(models, 10_000, batch_limit=64, names=["conv1", "conv2", "classifier"])
    err = info.value
    assert isinstance(err, BudgetTooSmallError)
    assert err.unit_index == 1 and err.unit_name == "conv2"
    assert err.min_feasible_bytes == 13001 == min_budget_bytes(models)
    assert err.budget_bytes == 10_000
    msg = str(err)
    assert "unit 1 (conv2)" in msg and "13001 bytes" in msg and "10000 bytes" in msg
    assert "raise the budget to at least" in msg
    # and that budget is indeed enough for every unit
    assert min(unit_batch_sizes(models, 13001, 64)) == 1
    with pytest.raises(UnitDoesNotFitError):
        unit_batch_sizes(models, 13000, 64)


def test_numpy_numbers_are_taken_as_their_values():
    """Profiles computed with numpy (np.float32 fits, np.int64 limits) give the same blocks as Python numbers."""
    np = pytest.importorskip("numpy")
    models = [(1000.0, 5000.0), (4000.0, 9000.5), (10.0, 20.0), (12.0, 22.0)]
    expected = partition(models, 100_000, batch_limit=64, rho=0.4)
    as_numpy = [(np.float64(a), np.float32(b)) for a, b in models]
    assert partition(as_numpy, np.float32(100_000), batch_limit=np.int64(64), rho=np.float64(0.4)) == expected
    assert all(type(b.batch_size) is int for b in expected)


def test_a_measured_unit_error_does_not_claim_to_cover_every_unit():
    err = UnitDoesNotFitError(10_000, 12_345, 3, unit_bytes=12_345, measured=True)
    msg = str(err)
    assert "unit 3 needs" in msg and "(measured)" in msg and "12345 bytes" in msg
    assert "Every unit" not in msg and "a later unit may need more" in msg


def test_argument_validation():
    models = [(1, 1)]
    for kwargs, text in [({"rho": -0.1}, "rho"), ({"batch_limit": 0}, "batch_limit"),
                         ({"budget_bytes": 0}, "budget_bytes"), ({"budget_bytes": -5}, "budget_bytes"),
                         ({"names": ["a", "b"]}, "names")]:
        args = {"budget_bytes": 100, "batch_limit": 8, **kwargs}
        with pytest.raises(ValueError, match=text):
            partition(models, **args)
    with pytest.raises(ValueError, match="per unit"):
        partition([], 100, 8)


# ----------------------------------------------------------------------------- brute-force reference

def reference_partition(models, budget, limit, rho_num, rho_den):
    """Written differently on purpose: linear search for t, then cut wherever a neighbour differs too much."""
    sizes = []
    for a, b in models:
        t = 0
        while t < limit and a * (t + 1) + b <= budget:   # integer a, b: exact
            t += 1
        sizes.append(t)
    if min(sizes) < 1:
        return None
    cuts = [0] + [i for i in range(1, len(sizes)) if rho_den * abs(sizes[i] - sizes[i - 1]) > rho_num * sizes[i - 1]]
    bounds = cuts + [len(sizes)]
    return [(tuple(range(s, e)), min(sizes[s:e])) for s, e in zip(bounds, bounds[1:])]


def test_matches_brute_force_on_random_inputs():
    rng = random.Random(0)
    checked = 0
    for _ in range(400):
        n = rng.randint(1, 12)
        budget = rng.randint(1_000, 200_000)
        models = [(rng.randint(1, 5_000), rng.randint(0, 150_000)) for _ in range(n)]
        limit = rng.choice([1, 4, 32, 256])
        rho_num, rho_den = rng.choice([(0, 10), (1, 10), (2, 5), (7, 10), (1, 1)])
        expected = reference_partition(models, budget, limit, rho_num, rho_den)
        if expected is None:
            with pytest.raises(UnitDoesNotFitError):
                partition(models, budget, limit, rho=rho_num / rho_den)
            continue
        got = partition(models, budget, limit, rho=rho_num / rho_den)
        assert [(b.units, b.batch_size) for b in got] == expected, (models, budget, limit, rho_num / rho_den)
        checked += 1
    assert checked > 100


def test_save_and_load_blocks(tmp_path):
    blocks = group([10, 13, 18, 30, 31, 100])
    path = tmp_path / "out" / "blocks.json"
    save_blocks(path, blocks, {"budget_bytes": 1000, "rho": 0.4})
    loaded, meta = load_blocks(path)
    assert loaded == blocks and meta == {"budget_bytes": 1000, "rho": 0.4}
    assert loaded[0].to_dict() == {"index": 0, "units": [0, 1, 2], "batch_size": 10}
    with pytest.raises(FileNotFoundError, match="partition"):
        load_blocks(tmp_path / "missing.json")


def test_a_truncated_blocks_file_is_a_clear_error_naming_it_and_the_fix(tmp_path):
    from edgeflux.artifacts import CorruptFileError

    path = tmp_path / "blocks.json"
    save_blocks(path, [Block(index=0, units=(0, 1), batch_size=8)])
    path.write_text(path.read_text()[:20])
    with pytest.raises(CorruptFileError, match=r"blocks.json is not valid JSON.*dvc repro partition"):
        load_blocks(path)
