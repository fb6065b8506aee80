"""Drawn config values and whole configs: a valid run setup or one clean error."""

from hypothesis import example, given, settings
from hypothesis import strategies as st

from fedml_perfedavg.run.config import ConfigError, resolve
from fedml_perfedavg.run.schema import BY_NAME, algorithm_fields
from fedml_perfedavg.run.schema import settings as config_settings


NUMERIC_OR_CHOICE = [f for f in config_settings() if f.metadata["kind"] in (int, float, bool) or f.metadata["choices"]]


@settings(max_examples=300, deadline=None)
@given(
    key=st.sampled_from(NUMERIC_OR_CHOICE),
    value=st.one_of(
        st.text(max_size=8),
        st.floats(allow_nan=True, allow_infinity=True),
        st.integers(-(10**6), 10**6),
        st.booleans(),
        st.none(),
        st.lists(st.integers(), max_size=3),
    ),
)
@example(key=BY_NAME["images_per_class"], value=2)  # too few for a batch: a rule with another key
@example(key=BY_NAME["client_num_in_total"], value=1)  # fewer than a round's clients
@example(key=BY_NAME["test_images_per_class"], value=10**5)  # more than the test set holds
def test_random_config_values_are_accepted_or_rejected_with_a_clear_message(key, value):
    try:
        config = resolve({}, {key.name: value})
    except ConfigError as err:
        # the key that was set, with its section: its own error, or a rule relating it to another key
        assert f"{key.metadata['section']}.{key.name}" in str(err), (key.name, value, str(err))
    else:
        if key.name in algorithm_fields() and key.name not in config.algorithm_values:
            return  # another algorithm's key: its value checked, then named in a warning, not kept
        assert (
            config.setting(key.name) == value
            or (value is None and key.default is None)
            or float(config.setting(key.name)) == float(value)
        )


@settings(max_examples=150, deadline=None)
@given(
    st.fixed_dictionaries(
        {},
        optional={
            "client_num_in_total": st.integers(-2, 120),
            "client_num_per_round": st.integers(-1, 60),
            "images_per_class": st.one_of(st.none(), st.integers(-2, 2000)),
            "batch_size": st.integers(-1, 1200),
            "hessian_batch_size": st.one_of(st.none(), st.integers(0, 600)),
            "new_user_fraction": st.floats(-0.5, 1.5),
            "partition_method": st.sampled_from(["paper", "paper_diff_hetero", "hetero"]),
            "dataset": st.sampled_from(["mnist", "cifar10", "femnist"]),
            "backend": st.sampled_from(["sp", "MPI", "GRPC"]),
            "training_type": st.sampled_from(["simulation", "cross_silo"]),
            "min_clients_per_round": st.integers(0, 12),
            "federated_optimizer": st.sampled_from(["PerFedAvg", "FedAvgUpdate", "FedAvg", "PerFedAv"]),
            "beta": st.floats(-1, 1),
            "learning_rate": st.floats(0, 1),
        },
    )
)
def test_whole_configs_are_valid_run_setups_or_one_clean_error(values):
    """Drawn whole configs: either every rule holds (the split fits the dataset, batches fit the
    smallest user) or the error names a key."""
    from fedml_perfedavg.data.loading import DATASETS
    from fedml_perfedavg.data.partition import plan_users

    try:
        config = resolve({}, dict(values))
    except ConfigError as err:
        # section.key=value of a key the config knows, first thing in the message
        import re

        from fedml_perfedavg.run.fedml_keys import FEDML_KEYS
        from fedml_perfedavg.run.schema import BY_NAME

        named = re.match(r"^(\w+_args)\.(\w+)=", str(err))
        assert named and (named.group(2) in BY_NAME or named.group(2) in FEDML_KEYS), str(err)
        return
    assert 1 <= config.train.client_num_per_round <= config.train.client_num_in_total
    if config.data.partition_method in ("paper", "paper_diff_hetero"):
        spec = DATASETS[config.data.dataset]
        plans = plan_users(
            config.train.client_num_in_total,
            config.data.images_per_class or spec.images_per_class,
            config.data.partition_method,
            config.common.random_seed,
        )
        assert max(config.batch_sizes) <= min(p.total for p in plans)
        for cls, have in enumerate(spec.train_class_counts):
            assert sum(p.class_counts.get(cls, 0) for p in plans) <= have
