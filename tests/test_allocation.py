"""The per-head budget rules (``stages.decide.allocation``) on hand-worked cases: PyramidKV's
schedule, DuoAttention's heads and AdaKV's share of a layer by score, each at the memory of
a whole-token budget."""
import pytest
import torch

from positronic_brain.stages.decide.allocation import adaptive, duo, pyramid, shares
from positronic_brain.types import UserError


def test_shares_add_up_and_give_the_units_left_to_the_largest_remainders():
    assert shares(10, [1, 1, 1]) == [4, 3, 3]  # 3.33 each: the first of equal ones first
    assert shares(7, [0.5, 0.25, 0.25]) == [3, 2, 2]  # 3.5, 1.75, 1.75: .75 > .5
    assert shares(0, [1, 2]) == [0, 0]
    with pytest.raises(UserError):
        shares(3, [0, 0])


def test_pyramid_falls_from_the_first_layer_to_the_last():
    # budget 100, 20 protected: 80 scored; beta 20: 4 at the top, 156 at the bottom,
    # 50.67 less per layer: 156, 105.33, 54.67, 4 (+20 each), 400 in all
    assert pyramid(100, 4, 20) == [176, 125, 75, 24]
    assert sum(pyramid(100, 4, 20)) == 400
    assert pyramid(64, 30, 20, beta=2) == sorted(pyramid(64, 30, 20, beta=2), reverse=True)
    assert sum(pyramid(64, 30, 20, beta=2)) == 64 * 30
    assert pyramid(100, 1, 20) == [100] and pyramid(20, 3, 20) == [20, 20, 20]
    with pytest.raises(UserError, match="beta"):
        pyramid(100, 4, 20, beta=0.5)


def test_duo_gives_streaming_heads_their_window_and_retrieval_heads_the_rest():
    retrieval = torch.tensor([[True, False], [False, False]])
    # 2 layers x 2 heads x budget 10 = 40 pairs; three streaming heads keep 4 each: 28 left
    assert duo(retrieval, 10, 4).tolist() == [[28, 4], [4, 4]]
    both = torch.tensor([[True, False], [False, True]])
    assert duo(both, 10, 4).tolist() == [[16, 4], [4, 16]]
    with pytest.raises(UserError, match="no retrieval head"):
        duo(torch.zeros(2, 2, dtype=torch.bool), 10, 4)


def test_adaptive_shares_a_layer_by_score_with_a_floor_per_head():
    scores = torch.tensor([[9., 8, 7, 6, 5, 4],
                           [.1, .2, .3, .4, .5, .6]])
    # budget 3 a head: 6 places; the floor keeps int(3 x 0.34) = 1 token in each head (its
    # best: head 0's token 0, head 1's token 5), the other 4 places go to head 0's next best
    kept = adaptive(scores, 3, floor=0.34)
    assert kept.tolist() == [[True] * 5 + [False], [False] * 5 + [True]]
    # without a floor head 1 keeps nothing; with floor 1 each head keeps its own 3
    assert adaptive(scores, 3, floor=0).sum(1).tolist() == [6, 0]
    assert adaptive(scores, 3, floor=1).tolist() == [[True] * 3 + [False] * 3,
                                                    [False] * 3 + [True] * 3]
    assert int(adaptive(torch.rand(3, 50), 16).sum()) == 48  # the layer's memory, always


def test_adaptive_breaks_ties_by_head_then_token():
    kept = adaptive(torch.ones(2, 4), 2, floor=0)
    assert kept.tolist() == [[True] * 4, [False] * 4]
