"""The planner of sharded optimizer state (keras_dist._keras.zero_partition): no MPI."""

import pytest

from keras_dist._keras.zero_partition import Piece, Tensor, imbalance, loads, plan
from keras_dist.bench.zero_balance import bert_base, gpt2_base


def _covers_every_row_once(tensors, pieces):
    for tensor, own in zip(tensors, pieces):
        rows = [row for piece in own for row in range(piece.start, piece.stop)]
        assert rows == list(range(tensor.rows)), (tensor, own)


def test_whole_variables_go_largest_first_to_the_least_loaded_rank():
    tensors = [Tensor((3,)), Tensor((10, 2)), Tensor((5, 2)), Tensor((4, 2))]
    pieces = plan(tensors, 2)
    assert pieces == [(Piece(1, 0, 3),), (Piece(0, 0, 10),), (Piece(1, 0, 5),),
                      (Piece(1, 0, 4),)]
    assert loads(tensors, pieces, 2) == [80, 84]


def test_the_plan_is_the_same_whatever_asks_and_ties_go_to_the_lowest_rank():
    tensors = [Tensor((4, 4)), Tensor((4, 4)), Tensor((4, 4))]
    assert plan(tensors, 3) == plan(list(tensors), 3)
    assert [own[0].rank for own in plan(tensors, 3)] == [0, 1, 2]


def test_splittable_variables_fill_each_rank_to_the_even_share():
    tensors = [Tensor((100, 8), splittable=True), Tensor((8,), splittable=True),
               Tensor((3, 8), splittable=True)]
    for ranks in (2, 3, 4, 7):
        pieces = plan(tensors, ranks)
        _covers_every_row_once(tensors, pieces)
        load = loads(tensors, pieces, ranks)
        assert max(load) - sum(load) / ranks <= 8 * 4, (ranks, load)


def test_whole_and_split_variables_together():
    tensors = [Tensor((50, 4)), Tensor((200, 4), splittable=True), Tensor((6,))]
    pieces = plan(tensors, 3)
    _covers_every_row_once(tensors, pieces)
    assert len(pieces[0]) == 1 and len(pieces[2]) == 1  # never split
    assert len(pieces[1]) > 1
    load = loads(tensors, pieces, 3)
    assert max(load) <= sum(load) / 3 + 16


def test_more_ranks_than_variables_leaves_some_ranks_nothing():
    pieces = plan([Tensor((2,)), Tensor(())], 4)
    assert sorted(own[0].rank for own in pieces) == [0, 1]
    assert loads([Tensor((2,)), Tensor(())], pieces, 4)[2:] == [0, 0]


@pytest.mark.parametrize("ranks", [0, -1, 1.5, True])
def test_ranks_must_be_a_positive_integer(ranks):
    with pytest.raises(ValueError, match="`ranks` must be an integer >= 1"):
        plan([Tensor((2,))], ranks)


@pytest.mark.parametrize("model,counts", [(gpt2_base, 124_439_808), (bert_base, 109_482_240)])
def test_kerashub_shapes_balance_within_the_target(model, counts):
    shapes = model()
    assert sum(Tensor(s).bytes for s in shapes) // 4 == counts  # KerasHub's parameter counts
    for ranks in (2, 4, 8):
        assert imbalance([Tensor(s, splittable=True) for s in shapes], ranks) < 1.01
    for ranks in (2, 4):  # whole variables (Adafactor, Lamb, Muon)
        assert imbalance([Tensor(s) for s in shapes], ranks) < 1.3
