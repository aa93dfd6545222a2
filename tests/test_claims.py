"""labkit.claims: a timing claim holds within its band and fails, with a message, outside it."""

import itertools

import pytest

from labkit.claims import Estimate, hold, measure


def test_band_is_drawn_from_the_spread():
    tight = Estimate((1.0, 1.01, 0.99, 1.0, 1.02))
    wide = Estimate((1.0, 1.5, 0.5, 1.0, 2.0))
    assert tight.median == wide.median == 1.0
    assert tight.halfwidth < wide.halfwidth


def test_a_true_claim_holds_and_a_false_one_fails_with_what_was_measured():
    est = Estimate((3.1, 2.9, 3.0, 3.05, 2.95))
    hold(est, 2.4, 3.6, "step growth (ms)")
    with pytest.raises(AssertionError) as info:
        hold(Estimate((0.1, 0.0, 0.05, -0.05, 0.02)), 2.4, 3.6, "step growth (ms)",
             below="the extra work was hidden")
    message = str(info.value)
    assert "step growth (ms)" in message and "median 0.02" in message
    assert "below the claim's range 2.4 to 3.6: the extra work was hidden" in message


def test_a_noisy_measurement_is_measured_again_until_it_can_decide():
    noisy = itertools.cycle([1.0, 3.0, 2.0, 2.1, 1.9, 2.0, 2.05, 1.95])
    est = measure(lambda: next(noisy), n=3, max_n=20, width=0.2)
    assert len(est.samples) > 3 and est.halfwidth <= 0.2
    capped = measure(lambda: next(noisy), n=3, max_n=4, width=1e-9)
    assert len(capped.samples) == 4
