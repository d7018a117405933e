"""The pod's state poll (pod/state.py) in process: a management API that answers late does not
turn a model that was ready or failed into "loading" at once."""
from pod.state import FAILED, HOLD_S, LOADING, READY, UNANSWERED, held

LATE = (LOADING, f"{UNANSWERED}timed out")


def test_a_late_answer_keeps_the_last_ready_or_failed_state_for_a_while():
    for last in ((READY, None, 100.0), (FAILED, "bad: its artifact does not match", 100.0)):
        assert held(last, LATE, True, 100.0 + HOLD_S - 1) == last[:2]
        assert held(last, LATE, True, 100.0 + HOLD_S + 1) == LATE  # silent for longer: not held


def test_only_an_unanswered_poll_of_a_live_frontend_is_held():
    last = (READY, None, 100.0)
    assert held(last, LATE, False, 101.0) == LATE  # the frontend does not answer /ping either
    assert held(last, (FAILED, "its worker failed"), True, 101.0) == (FAILED, "its worker failed")  # an answer
    assert held(last, (LOADING, "the handler is loading"), True, 101.0) == (LOADING, "the handler is loading")
    assert held(None, LATE, True, 101.0) == LATE  # never answered yet
    assert held((LOADING, "the handler is loading", 100.0), LATE, True, 101.0) == LATE
