"""The CPU kernels' threads when ranks share a node (hvd_qsgd.threads)."""
import pytest

from hvd_qsgd import codec, threads


def test_the_node_cores_are_divided_among_its_ranks(monkeypatch):
    monkeypatch.setattr(codec, "_threads_chosen", False)
    assert threads.threads_for(8, env={}, cores=16, usable=16) == 2
    assert threads.threads_for(2, env={}, cores=2, usable=2) == 1
    assert threads.threads_for(1, env={}, cores=16, usable=16) == 16
    assert threads.threads_for(32, env={}, cores=16, usable=16) == 1   # at least one


def test_a_rank_its_launcher_bound_keeps_its_cores(monkeypatch):
    monkeypatch.setattr(codec, "_threads_chosen", False)
    assert threads.threads_for(8, env={}, cores=64, usable=8) == 8


def test_a_choice_made_is_kept_or_taken(monkeypatch):
    monkeypatch.setattr(codec, "_threads_chosen", False)
    assert threads.threads_for(8, env={"OMP_NUM_THREADS": "4"}, cores=16, usable=16) is None
    assert threads.threads_for(8, env={threads.ENV: "3", "OMP_NUM_THREADS": "4"}, cores=16, usable=16) == 3
    monkeypatch.setattr(codec, "_threads_chosen", True)   # codec.set_num_threads was called
    assert threads.threads_for(8, env={}, cores=16, usable=16) is None
    assert threads.threads_for(8, env={threads.ENV: "5"}, cores=16, usable=16) == 5


@pytest.mark.parametrize("value", ["0", "-2", "two", "1.5", ""])
def test_a_malformed_setting_names_the_variable(value):
    with pytest.raises(ValueError, match=f"{threads.ENV} must be a positive integer"):
        threads.threads_for(2, env={threads.ENV: value}, cores=4, usable=4)


def test_set_num_threads_is_remembered_as_a_choice(monkeypatch):
    monkeypatch.setattr(codec, "_threads_chosen", False)
    before = codec.get_num_threads()
    try:
        codec.set_num_threads(1)
        assert codec._threads_chosen and codec.get_num_threads() == 1
    finally:
        codec.set_num_threads(before)
