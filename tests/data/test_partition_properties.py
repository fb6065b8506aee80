"""Properties of the paper's split for any seed and size."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from fedml_perfedavg.data.partition import partition_indices, plan_users


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    half=st.integers(1, 10),
    a=st.integers(1, 10),
    partition=st.sampled_from(["paper", "paper_diff_hetero"]),
)
def test_partition_properties_for_any_seed(seed, half, a, partition):
    a *= 2
    labels = np.random.default_rng(seed).permutation(np.repeat(np.arange(10), 5 * a * half))
    plans = plan_users(2 * half, a, partition, seed)
    users = partition_indices(labels, plans, seed)
    flat = np.concatenate(users)
    assert len(flat) == len(np.unique(flat))  # every sample used at most once
    for idx, plan in zip(users, plans):
        assert {c: int((labels[idx] == c).sum()) for c in plan.class_counts} == plan.class_counts
        assert set(labels[idx].tolist()) == set(plan.class_counts)
