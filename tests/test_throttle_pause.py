"""The pause before a throttled request is sent again (issue 44 item 1): short while a store throttles a request
now and then, botocore's own (from 1 s, doubling) while it throttles every request, never under ``Retry-After``."""

from __future__ import annotations

from taskpoint.storage.throttle import SHARE_WINDOW, THROTTLE_MAX_DELAY, Pushback

#: Draws of each pause: enough that a range's upper part is reached (the chance that 200 uniform draws all fall
#: in its lower fifth is 0.2 ** 200).
DRAWS = 200


def _throttling_one_in(every: int, answers: int) -> Pushback:
    """A store's pushback after ``answers`` answers of which every ``every``-th throttled."""
    pushback = Pushback("test://store")
    for index in range(1, answers + 1):
        if index % every == 0:
            pushback.throttle()
        else:
            pushback.answered()
    return pushback


def test_the_share_of_throttled_answers_follows_what_the_store_says_lately():
    pushback = _throttling_one_in(10, 400)
    assert 0.05 < pushback.share < 0.2
    for _ in range(4 * SHARE_WINDOW):
        pushback.throttle()
    assert pushback.share > 0.9
    for _ in range(8 * SHARE_WINDOW):
        pushback.answered()
    assert pushback.share < 0.01


def test_a_store_that_throttles_one_request_in_ten_is_asked_again_soon():
    pushback = _throttling_one_in(10, 400)
    pushback.throttle()  # the answer whose request is about to be sent again
    bound = THROTTLE_MAX_DELAY * pushback.share ** 2
    assert bound < 0.1 * THROTTLE_MAX_DELAY
    assert all(pushback.pause(1) <= bound for _ in range(DRAWS))


def test_a_store_that_throttles_every_request_gets_pauses_that_double_with_each_attempt():
    pushback = _throttling_one_in(1, 4 * SHARE_WINDOW)
    for attempt in (1, 2, 3, 4):
        bound = THROTTLE_MAX_DELAY * 2 ** (attempt - 1)
        pauses = [pushback.pause(attempt) for _ in range(DRAWS)]
        assert all(0 <= pause <= bound for pause in pauses)
        assert max(pauses) > 0.8 * bound * pushback.share ** 2


def test_a_retry_after_is_the_shortest_pause_whatever_the_share():
    assert all(Pushback("test://store").pause(1, 2.5) >= 2.5 for _ in range(DRAWS))
    assert all(_throttling_one_in(1, 100).pause(3, 7.0) >= 7.0 for _ in range(DRAWS))
