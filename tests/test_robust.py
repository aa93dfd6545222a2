"""The engine survives errors and bad settings: device failures, impossible requests, bad
engine settings, bounded mask caches. Every test that could hang runs under a deadline."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from labkit import decoders
from labkit.constraints_json import parse_constraint
from labkit.device import DeviceError, ProcessDevice
from labkit.engine import Engine
from labkit.model import LlamaModel, ModelConfig, init_random
from labkit.sampling import SamplingParams
from labkit.scheduler import RequestError
from labkit.vocab import ConstraintError, Vocab
from tests.deadline import deadline

CFG = ModelConfig.tiny()
MODEL = init_random(LlamaModel(CFG).eval(), seed=1)
EOS = 2
_PIECES = list('{}":, .-0123456789') + ['"x', '"y', "_min", "_max", "yes", "no"]
VOCAB = Vocab([""] * 3 + _PIECES + [""] * (CFG.vocab_size - 3 - len(_PIECES)), eos_id=EOS)


def engine(device: str = "inprocess", **kw) -> Engine:
    kw = {"kv_tokens": 256, "block_size": 8, "max_seqs": 4, **kw}
    e = Engine(MODEL, None, device=device, **kw)
    e.eos_id = EOS
    return e


# -- a device that fails -------------------------------------------------------------------------

@pytest.mark.parametrize("decoder", ["blocking", "pipelined"])
def test_a_device_fault_is_a_sticky_device_error_with_its_traceback(decoder):
    """Regression: the error went on a queue the host checked once: the host committed the
    previous step's buffer as fresh tokens, or waited forever; close() then took 10 s."""
    e = engine("process")
    try:
        rids = [e.submit([5 + i, 6], SamplingParams(max_new_tokens=40, ignore_eos=True))
                for i in range(2)]
        e.on_step = lambda eng: eng.device.inject("fault", "boom") if eng.steps == 4 else None
        with deadline(30, "a run on a failed device"):
            with pytest.raises(DeviceError, match="(?s)Traceback.*injected device fault: boom"):
                decoders.run(e, decoder)
        e.on_step = None
        committed = [len(e.seqs[r].output_ids) for r in rids]
        assert all(n <= 5 for n in committed), committed  # nothing after the fault
        assert all(s.inflight_refs == 0 for s in e.seqs.values())  # consistent
        e.device.proc.join(timeout=10)
        assert not e.device.proc.is_alive(), "a failed device must exit"
        t0 = time.monotonic()
        with deadline(10, "a call on a failed device"):  # every later call raises at once
            e.submit([7], SamplingParams(max_new_tokens=3))
            with pytest.raises(DeviceError, match="injected device fault"):
                decoders.run(e, decoder)
        assert time.monotonic() - t0 < 2
    finally:
        t0 = time.monotonic()
        e.close()
        assert time.monotonic() - t0 < 3, "close() after a failure must be fast"


def test_a_stalled_device_is_reported_with_what_it_was_doing():
    e = engine("process")
    e.device.stall_timeout_s = 1.0
    try:
        e.submit([5, 6], SamplingParams(max_new_tokens=40, ignore_eos=True))
        e.on_step = lambda eng: eng.device.inject("stall", 60) if eng.steps == 3 else None
        with deadline(30, "a run on a stalled device"):
            with pytest.raises(DeviceError, match="stalled.*was running stall"):
                decoders.run(e, "pipelined")
        assert all(s.inflight_refs == 0 for s in e.seqs.values())
    finally:
        t0 = time.monotonic()
        e.close()
        assert time.monotonic() - t0 < 3


def test_the_host_never_reads_a_buffer_stamped_with_another_step():
    """The copy of each step is stamped: waiting for a step whose copy never came times out
    as a stall instead of returning the previous step's tokens."""
    e = engine("process")
    e.device.stall_timeout_s = 1.0
    try:
        e.submit([5, 6], SamplingParams(max_new_tokens=3, ignore_eos=True))
        decoders.run(e, "blocking")  # fills both... slot 0 holds a finished step
        dev = e.device
        dev._slot_step[0] += 100  # the host now waits for a step that was never launched
        with deadline(20, "waiting for a step never copied"):
            with pytest.raises(DeviceError, match="stalled"):
                dev.wait_tokens(0)
    finally:
        e.close()


@pytest.mark.parametrize("decoder", ["blocking", "pipelined"])
def test_an_in_process_device_error_leaves_the_engine_usable(decoder):
    """Regression: an exception from the device left inflight_refs at 1: the next run spun."""
    e = engine("inprocess")
    forward = e.device.runner.forward
    calls = []

    def failing(plan):
        calls.append(plan.step)
        if len(calls) == 4:
            raise RuntimeError("device fell over")
        return forward(plan)
    e.device.runner.forward = failing
    rids = [e.submit([5 + i], SamplingParams(max_new_tokens=6, ignore_eos=True))
            for i in range(2)]
    with deadline(30, "runs after a device error"):
        with pytest.raises(RuntimeError, match="fell over"):
            decoders.run(e, decoder)
        assert all(s.inflight_refs == 0 for s in e.seqs.values())
        decoders.run(e, decoder)  # the rest completes
    e.check_all_released()
    assert all(e.seqs[r].finalized for r in rids)


def test_a_loop_that_finds_nothing_to_do_raises_instead_of_spinning():
    e = engine("inprocess")
    rid = e.submit([5], SamplingParams(max_new_tokens=4))
    e.scheduler._admit_one()  # running, as if a step had admitted it
    seq = e.seqs[rid]
    seq.finalized, seq.inflight_refs = True, 1  # as an uncommitted step used to leave it
    for decoder in ("blocking", "pipelined"):
        with deadline(10, f"{decoder} with a leaked reference"):
            with pytest.raises(RuntimeError, match=r"scheduler stuck.*\(0, 1\)"):
                decoders.run(e, decoder)


# -- requests that cannot complete are refused before anything is queued --------------------------

def test_generate_queues_nothing_when_a_constrained_request_is_refused():
    """Regression: the pages were checked with the cap before the constraint raised it."""
    import labkit
    e = engine("inprocess", kv_tokens=64)  # 8 pages of 8: a box answer does not fit
    e.__dict__["vocab"] = VOCAB  # the cached property, for an engine without a tokenizer
    box = {"box": {"min": 0, "max": 1, "decimals": 3}}
    with pytest.raises(RequestError, match="KV pages"):
        labkit.generate([[5, 6], [7, 8]], SamplingParams(max_new_tokens=2), engine=e,
                        constraints=[None, box])
    assert e.scheduler.idle() and not e.seqs, "a refused generate queued requests"


def test_a_constrained_answer_that_cannot_finish_is_refused_at_submit():
    e = engine("inprocess", kv_tokens=4096, max_seqs=2)
    box = parse_constraint({"box": {"min": 0, "max": 1, "decimals": 3}}, VOCAB)
    long_prompt = [5] * (e.scheduler.context_len - 20)  # the answer needs ~60 tokens
    with pytest.raises(RequestError, match="could not finish"):
        e.submit(long_prompt, SamplingParams(max_new_tokens=4), constraint=box)
    with pytest.raises(ConstraintError, match="digits"):  # was decimal.Overflow mid-answer
        parse_constraint({"point": {"min": 0, "max": 1, "decimals": 10**6}}, VOCAB)


def test_a_stop_id_never_ends_a_constrained_answer_midway():
    import json
    e = engine("inprocess")
    point = parse_constraint({"point": {"min": 0, "max": 1, "decimals": 2}}, VOCAB)
    stops = tuple(VOCAB.token_strings.index(c) for c in '":, .0123456789')  # every inner char
    rids = [e.submit([5 + i], SamplingParams(max_new_tokens=4, temperature=1.0, seed=i,
                                             stop_ids=stops), constraint=point)
            for i in range(3)]
    decoders.run(e, "pipelined")
    for r in rids:
        text = "".join(VOCAB.token_strings[t] for t in e.seqs[r].output_ids if t != EOS)
        assert set(json.loads(text)) == {"x", "y"}, text


# -- settings that could never run are refused when the engine is built ---------------------------

@pytest.mark.parametrize("kw,name", [({"max_seqs": 0}, "max_seqs"),
                                     ({"kv_tokens": 4}, "kv_tokens"),
                                     ({"block_size": 0}, "block_size"),
                                     ({"num_adapter_slots": -1}, "num_adapter_slots"),
                                     ({"max_seqs": 2.5}, "max_seqs")])
def test_settings_that_could_never_run_are_refused_at_build(kw, name):
    """Regression: run() said "scheduler stuck" and blamed the request."""
    with pytest.raises(ValueError, match=f"Engine: {name}"):
        engine("inprocess", **kw)


# -- the process device's mask cache: keyed by content, bounded ------------------------------------

def test_process_device_masks_are_keyed_by_content_and_bounded():
    """Regression: the device's mask dict only grew (16, 32, 44 masks after 10, 20, 30
    requests); keys were ids of host tensors."""
    import torch
    e = engine("process", max_seqs=2)
    e.device.close()
    cap = 3
    e.device = ProcessDevice(MODEL, 32, 8, e.scheduler.rows.size, mask_cache_cap=cap)
    ref = engine("inprocess", max_seqs=2)
    try:
        out = {}
        for eng in (e, ref):
            rids = []
            for i in range(8):  # more distinct masks than the cache holds, in fresh tensors
                allowed = torch.zeros(CFG.vocab_size, dtype=torch.bool)
                allowed[[10 + i % 5, 20 + i % 5]] = True
                seq_id = eng.submit([5 + i], SamplingParams(max_new_tokens=3, temperature=1.0,
                                                            seed=i, ignore_eos=True))
                rids.append(seq_id)

                class Fixed:  # a constraint stand-in: the same allowed set every step
                    max_text_len = 1

                    def __init__(self, mask):
                        self.m = mask

                    def mask(self, state):
                        return self.m.clone()  # a new tensor each time: same content

                    def advance(self, state, tok):
                        return state

                    def is_done(self, state):
                        return False
                eng.seqs[seq_id].constraint = Fixed(allowed)
            with deadline(60, "constrained runs on the process device"):
                decoders.run(eng, "pipelined")
            out[eng] = [eng.seqs[r].output_ids for r in rids]
        assert out[e] == out[ref]  # evicted masks are sent again, never misapplied
        assert 0 < e.device.masks_held <= cap
        assert len(e.device._device_masks) <= cap and len(e.device._host_masks) <= cap
    finally:
        e.close()


@pytest.mark.parametrize("decoder", ["blocking", "pipelined"])
def test_a_launch_refused_after_its_plan_is_undone_with_the_same_tokens(decoder):
    """An error between plan and launch (here: the device refuses the forward) leaves no trace:
    the planned sequences are recomputed later, and the prefix pages that launch would have
    filled are not offered to anyone (their KV was never written)."""
    system = list(range(40, 72))  # two full pages of 16, shared by every request
    prompts = [system + [100 + i, 7, 9] for i in range(4)]

    def tokens(fail_at: int | None) -> list[list[int]]:
        e = engine("inprocess")
        rids = [e.submit(p, SamplingParams(max_new_tokens=6, ignore_eos=True)) for p in prompts]
        forward = e.device.launch_forward
        calls = [0]

        def flaky(slot, plan):
            calls[0] += 1
            if calls[0] == fail_at:
                raise DeviceError("refused once")
            forward(slot, plan)

        e.device.launch_forward = flaky
        with deadline(30, f"{decoder} after a refused launch"):
            if fail_at is not None:
                with pytest.raises(DeviceError, match="refused once"):
                    decoders.run(e, decoder)
                assert all(s.inflight_refs == 0 for s in e.seqs.values())
            decoders.run(e, decoder)
        e.check_all_released()
        out = [e.seqs[r].output_ids for r in rids]
        e.close()
        return out

    want = tokens(None)
    for fail_at in (1, 2, 4):  # the first prefill (names the shared pages), later mixed steps
        assert tokens(fail_at) == want, f"launch {fail_at} refused: different tokens"


@pytest.mark.parametrize("decoder", ["blocking", "pipelined"])
def test_an_interrupted_generate_cancels_and_forgets_its_own_requests(decoder):
    """Ctrl-C during labkit.generate: its 8 long requests must not stay queued for the next
    call, which would silently run them all."""
    import labkit

    e = engine(kv_tokens=8 * 1024)
    steps = []

    def on_step(eng):
        steps.append(eng.steps)
        if len(steps) == 3:
            raise KeyboardInterrupt
    e.on_step = on_step
    try:
        with pytest.raises(KeyboardInterrupt):
            labkit.generate([[5, 6, 7]] * 8, SamplingParams(max_new_tokens=900,
                                                            ignore_eos=True),
                            engine=e, decoder=decoder)
    finally:
        e.on_step = None
    assert not e.seqs, f"{len(e.seqs)} requests of the interrupted call are still held"
    e.check_all_released()
    before = e.steps
    out = labkit.generate([[5, 6, 7]], SamplingParams(max_new_tokens=3, ignore_eos=True),
                          engine=e, decoder=decoder)
    assert len(out[0].output_ids) == 3 and e.steps - before <= 4, (
        f"the next 3-token call ran {e.steps - before} steps")


def test_a_script_without_a_main_guard_gets_an_error_not_a_hang(tmp_path):
    """Regression: a script that builds a simulated-device engine at top level (no `if
    __name__ == '__main__':`) hung for good once the model had enough tensors: the spawned
    child re-ran the script, failed and exited, while the parent's start still wrote the
    model's handles (over 64 KB) into a pipe whose read end the parent itself held open."""
    script = tmp_path / "noguard.py"
    script.write_text(
        "import dataclasses\n"
        "from labkit.engine import Engine\n"
        "from labkit.model import LlamaModel, ModelConfig, init_random\n"
        "cfg = dataclasses.replace(ModelConfig.tiny(), num_layers=64)\n"
        "e = Engine(init_random(LlamaModel(cfg).eval(), seed=0), None, device='process',\n"
        "           max_seqs=2, kv_tokens=256)\n"
        "print('started without a guard')\n")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path, env=env)
    assert done.returncode != 0 and "started without a guard" not in done.stdout
    assert "__name__ == '__main__'" in done.stderr, done.stderr[-2000:]
