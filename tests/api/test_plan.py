import pytest

from sppo_fx import Plan, SppoError
from sppo_fx.plan import even_plan


def test_even_plan_spreads_remainder_to_first_chunks():
    assert even_plan(10, 3).chunk_lengths == [4, 3, 3]
    assert even_plan(10, 3).bounds() == [(0, 4), (4, 7), (7, 10)]


def test_plan_json_round_trip_and_table():
    plan = Plan(12, [5, 4, 3])
    assert Plan.from_json(plan.to_json()) == plan
    text = str(plan)
    assert "K/V prefix" in text and "9" in text


def test_fewer_tokens_than_chunks_names_the_fix():
    with pytest.raises(SppoError, match="use chunks <= 3"):
        even_plan(3, 4)


@pytest.mark.parametrize("lengths", [[4, 4], [0, 12], [13]])
def test_bad_chunk_lengths_rejected(lengths):
    with pytest.raises(SppoError):
        Plan(12, lengths)
