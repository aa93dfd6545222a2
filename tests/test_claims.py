"""labkit.claims: a timing claim holds within its band and fails, with a message, outside it."""

import dataclasses
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


def test_a_timing_runs_on_the_cores_other_programs_leave(monkeypatch):
    import os

    import torch

    from labkit import claims

    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(claims, "busy_elsewhere", lambda since: 0.0)
    assert claims.timing_threads(2, window_s=0) == 2
    monkeypatch.setattr(claims, "busy_elsewhere", lambda since: 0.9)  # one core nearly full
    assert claims.timing_threads(2, window_s=0) == 1
    monkeypatch.setattr(claims, "busy_elsewhere", lambda since: 0.5)  # half a core: still free
    assert claims.timing_threads(2, window_s=0) == 1
    monkeypatch.setattr(claims, "busy_elsewhere", lambda since: 0.7)
    assert claims.timing_threads(2, window_s=0) == 1
    monkeypatch.setattr(claims, "busy_elsewhere", lambda since: 5.0)  # never below one
    assert claims.timing_threads(2, window_s=0) == 1
    before = torch.get_num_threads()
    with claims.torch_threads(1) as n:
        assert n == 1 and torch.get_num_threads() == 1
    assert torch.get_num_threads() == before


def test_a_step_over_its_floor_moves_with_the_memory_measured_beside_it():
    from labkit.ceilings import StepOverFloor
    from labkit.model import LlamaModel, ModelConfig
    from labkit.roofline import get_hardware, step_cost

    model = LlamaModel(ModelConfig.tiny())
    hw = get_hardware("H200")
    pairs = StepOverFloor(model, hw, batch=1, context_len=64)
    pairs.step = lambda: 0.010  # a step of 10 ms, whatever the machine does
    floor = step_cost(model.cfg, 1, 64, "decode", "fp32", "fp32", hw).floor_s
    pairs._probe = lambda: hw.bandwidth  # memory as fast as the ceiling: the ceiling's floor
    assert pairs() == pytest.approx(0.010 / floor)
    pairs._probe = lambda: 2 * hw.bandwidth  # faster than a stale ceiling: the floor halves
    assert pairs() == pytest.approx(0.010 / step_cost(
        model.cfg, 1, 64, "decode", "fp32", "fp32",
        dataclasses.replace(hw, bandwidth=2 * hw.bandwidth)).floor_s)
    pairs._probe = lambda: hw.bandwidth / 4  # memory 4x slower now: the floor 4x higher
    slow = step_cost(model.cfg, 1, 64, "decode", "fp32", "fp32",
                     dataclasses.replace(hw, bandwidth=hw.bandwidth / 4)).floor_s
    assert slow > 3.5 * floor
    assert pairs() == pytest.approx(0.010 / slow)
    assert pairs.bandwidths == [hw.bandwidth, 2 * hw.bandwidth, hw.bandwidth / 4]


def _loaded(samples, busy, remeasure=None):
    return Estimate(tuple(samples), busy=busy, remeasure=remeasure)


FALSE = (9.0, 9.1, 8.9, 9.05, 8.95)  # a ratio of about 9 against the claim 1 to 3
TRUE = (2.0, 2.1, 1.9, 2.05, 1.95)


def test_a_claim_refuted_under_load_is_inconclusive_and_measured_again(capsys):
    again = iter([_loaded(TRUE, busy=0.1)])
    hold(_loaded(FALSE, busy=1.4, remeasure=lambda: next(again)), 1.0, 3.0, "step over floor")
    out = capsys.readouterr().out
    assert "other processes kept 1.4 cores busy: inconclusive under load" in out, out
    assert "measuring again (1 of 3)" in out and "the re-measure holds" in out, out


def test_a_false_claim_still_fails_under_load_when_every_re_measure_agrees():
    from labkit import claims

    calls = []

    def again():
        calls.append(1)
        return _loaded(FALSE, busy=1.4, remeasure=again)

    with pytest.raises(AssertionError) as info:
        hold(_loaded(FALSE, busy=1.4, remeasure=again), 1.0, 3.0, "step over floor",
             above="something else runs in the step")
    assert len(calls) == claims.REMEASURES
    message = str(info.value)
    assert "above the claim's range 1 to 3: something else runs in the step" in message
    assert f"measured {claims.REMEASURES + 1} times, every time outside" in message
    assert "other processes kept 1.4 cores busy" in message


def test_a_quiet_re_measure_that_refutes_the_claim_fails_at_once():
    calls = []

    def quiet():
        calls.append(1)
        return _loaded(FALSE, busy=0.0, remeasure=quiet)

    with pytest.raises(AssertionError, match="measured 2 times"):
        hold(_loaded(FALSE, busy=1.4, remeasure=quiet), 1.0, 3.0, "step over floor")
    assert len(calls) == 1


def test_a_quiet_refutation_is_not_measured_again():
    def never():
        raise AssertionError("a quiet estimate must not be re-measured")

    with pytest.raises(AssertionError, match="above the claim's range"):
        hold(_loaded(FALSE, busy=0.2, remeasure=never), 1.0, 3.0, "step over floor")
    hold(_loaded(TRUE, busy=1.9, remeasure=never), 1.0, 3.0, "a true claim under load")


def test_measure_records_the_load_and_re_measures_the_same_way(monkeypatch):
    import torch

    from labkit import claims

    load = iter([1.4, 0.0])  # busy while the first estimate is drawn, quiet for the second
    monkeypatch.setattr(claims, "busy_elsewhere", lambda since: next(load))
    values = itertools.chain([9.0] * 5, [2.0] * 5)  # slow under load, then as claimed
    threads = []

    def sample():
        threads.append(torch.get_num_threads())
        return next(values)

    with claims.torch_threads(1):
        est = measure(sample, n=5, max_n=5)
    assert est.busy == 1.4 and est.loaded and est.median == 9.0
    hold(est, 1.0, 3.0, "ratio")  # the re-measure (quiet, 2.0) decides
    assert len(threads) == 10 and set(threads) == {1}  # at the thread count it was measured at


def test_a_false_claim_measured_under_constant_load_fails(monkeypatch):
    from labkit import claims

    monkeypatch.setattr(claims, "busy_elsewhere", lambda since: 1.4)
    drawn = []
    est = measure(lambda: drawn.append(1) or 9.0 + 0.01 * (len(drawn) % 3), n=5, max_n=5)
    with pytest.raises(AssertionError, match="every time outside"):
        hold(est, 1.0, 3.0, "ratio")
    assert len(drawn) == 5 * (claims.REMEASURES + 1)
