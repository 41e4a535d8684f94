"""The layout checks the shm and hierarchical transports make at construction,
and the counts check of their allgatherv.

Both are pure functions of what every rank gathered, so every rank reaches the
same verdict and raises the same error.
"""

import pytest

from keras_dist.transports.hierarchical import _layout_problem
from keras_dist.transports.shm import _membership_problem


def test_one_machine_in_communicator_order_is_accepted():
    members = [([0, 1, 2], 2, "a", 11), ([0, 1, 2], 0, "a", 12), ([0, 1, 2], 1, "a", 13)]
    assert _membership_problem(members, 3) is None


def test_ranks_on_two_hosts_are_named_with_their_hosts():
    members = [([0, 1], 0, "a", 11), ([0, 1], 1, "b", 12)]
    problem = _membership_problem(members, 2)
    assert "one machine" in problem
    assert "rank 0 (world rank 0) on a" in problem and "rank 1 (world rank 1) on b" in problem


def test_disagreeing_or_repeated_group_ranks_are_reported():
    problem = _membership_problem([([4, 5], 0, "a", 1), ([4, 6], 1, "a", 2)], 2)
    assert problem == "the ranks disagree on `group_ranks`: rank 0 has [4, 5], rank 1 has [4, 6]"
    problem = _membership_problem([([4, 4], 0, "a", 1), ([4, 4], 1, "a", 2)], 2)
    assert "must name each of the 2 ranks once. Received: group_ranks=[4, 4]" in problem


def test_one_process_twice_is_reported():
    problem = _membership_problem([([0, 1], 3, "a", 1), ([0, 1], 3, "a", 1)], 2)
    assert "distinct process" in problem and "[3, 3]" in problem


def test_consistent_machines_are_accepted():
    # Group ranks 0 and 2 on machine 0, 1 on machine 1; world order reversed.
    machines = [[0, 2], [1]]
    everyone = [(2, "a", 0, 0), (1, "b", 1, 0), (0, "a", 0, 1)]
    assert _layout_problem(machines, everyone) is None


def test_a_rank_placed_elsewhere_than_it_says_is_named():
    machines = [[0, 1], [2]]
    everyone = [(0, "a", 0, 0), (1, "a", 1, 0), (2, "b", 1, 0)]
    problem = _layout_problem(machines, everyone)
    assert problem.startswith("rank 1 (world rank 1, host a) is local rank 0 of machine 1, "
                              "which lists [2]"), problem


def test_missing_ranks_and_split_machines_are_reported():
    assert "list each of the 3 ranks once" in _layout_problem(
        [[0, 1], [1]], [(0, "a", 0, 0), (1, "a", 0, 1), (2, "b", 1, 0)])
    problem = _layout_problem([[0, 1]], [(0, "a", 0, 0), (1, "b", 0, 1)])
    assert problem == "machine 0 spans hosts ['a', 'b'] (ranks [0, 1])"


def test_allgatherv_counts_are_one_per_rank_and_scaled_to_bytes():
    from keras_dist.transports.base import counts_in_bytes

    assert counts_in_bytes([3, 0, 5], 3, 8) == [24, 0, 40]
    with pytest.raises(ValueError, match=r"one entry per rank. Received: 2 entries \(size=3\)"):
        counts_in_bytes([1, 2], 3, 4)
