"""The digits example reads scikit-learn's bundled data without importing scikit-learn."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from training.examples.digits import load_bundled_digits, stratified_split


def test_bundled_data_is_exactly_what_load_digits_returns() -> None:
    from sklearn.datasets import load_digits

    x, y = load_bundled_digits()
    ref_x, ref_y = load_digits(return_X_y=True)
    assert np.array_equal(x, ref_x) and np.array_equal(y, ref_y)


def test_building_the_dataset_does_not_import_sklearn() -> None:
    code = (
        "import sys; from training.task import load_task; "
        "t = load_task('training.examples.digits:task', {}); t.train_dataset(); t.eval_dataset(); "
        "print('sklearn' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "False"


@settings(max_examples=30, deadline=None)
@given(held_out=st.floats(0.05, 0.5), seed=st.integers(0, 2**16))
def test_stratified_split_partitions_every_class_in_proportion(held_out: float, seed: int) -> None:
    _, y = load_bundled_digits()
    train, test = stratified_split(y, held_out, seed)
    assert len(np.intersect1d(train, test)) == 0 and len(train) + len(test) == len(y)
    assert len(test) == int(np.ceil(len(y) * held_out)), "the held-out size scikit-learn's split gives"
    for label in np.unique(y):
        n = int((y == label).sum())
        assert abs(int((y[test] == label).sum()) - n * held_out) < 1.0, "every class keeps its proportion"
    again = stratified_split(y, held_out, seed)
    assert np.array_equal(again[0], train) and np.array_equal(again[1], test)
