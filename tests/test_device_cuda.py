"""The CUDA device's own rules: no sync in a steady-state step, graphs that can be turned off and
fall back, buckets up to max_seqs, a clean close, masks cached by content.

Every test here is marked `cuda`: on a GPU machine scripts/gpu_check.sh runs them; on every
other machine tests/test_fake_cuda.py runs the same functions on the fake CUDA.
"""

import pytest
import torch

from labkit import decoders
from labkit.constraints_json import parse_constraint
from labkit.device_cuda import MaskCache
from labkit.engine import Engine
from labkit.model import LlamaModel, ModelConfig, init_random
from labkit.sampling import SamplingParams
from labkit.vocab import Vocab

CFG = ModelConfig.tiny()
MODEL = init_random(LlamaModel(CFG).eval(), seed=3)
EOS = 2
_PIECES = list('{}":, .-0123456789') + ['{"', '"x', '"y', '": ', ', "', "0.", "1.", "x_",
                                        "yes", "no", "maybe", "ye", "s", "n", "o", "x"]
VOCAB = Vocab([""] * 3 + _PIECES + [""] * (CFG.vocab_size - 3 - len(_PIECES)), eos_id=EOS)


def engine(cache: str = "paged", max_seqs: int = 6) -> Engine:
    e = Engine(MODEL, None, kv_tokens=512, block_size=8, max_seqs=max_seqs, device="cuda",
               cache=cache)
    e.eos_id = EOS
    return e


def run_workload(e: Engine, decoder: str = "pipelined") -> list[list[int]]:
    """Greedy, sampled and constrained requests; two arrive mid-run (prefill beside decode)."""
    specs = [None, None, {"choice": ["yes", "no", "maybe"]},
             {"point": {"min": 0, "max": 1, "decimals": 2}}, None]
    reqs = [([3 + i] * (1 + 3 * i), SamplingParams(max_new_tokens=8 + i, temperature=0.9 * (i % 2),
                                                   seed=i, ignore_eos=spec is None), spec)
            for i, spec in enumerate(specs)]
    ids: list[int] = []
    start = e.steps

    def on_step(eng):
        while len(ids) < len(reqs) and (len(ids) < 3 or eng.steps - start >= 4):
            prompt, params, spec = reqs[len(ids)]
            c = parse_constraint(spec, VOCAB) if spec else None
            ids.append(eng.submit(prompt, params, constraint=c))
    e.on_step = on_step
    try:
        on_step(e)
        decoders.run(e, decoder)
    finally:
        e.on_step = None
    e.check_all_released()
    return [e.seqs[i].output_ids for i in ids]


@pytest.mark.cuda
@pytest.mark.parametrize("cache", ["paged", "contiguous"])
def test_steady_state_pipelined_steps_never_sync(cache):
    """Once every bucket is captured, a pipelined step only enqueues: under
    set_sync_debug_mode("error") any .item(), nonzero, boolean index or pageable copy raises."""
    e = engine(cache)
    try:
        warm = run_workload(e)  # captures the graphs these shapes use
        torch.cuda.set_sync_debug_mode("error")
        try:
            checked = run_workload(e)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        assert checked == warm
        if e.device.graphs is not None and cache == "paged":
            assert e.device.graphs.graphs and not e.device.graphs.failed
    finally:
        e.close()


@pytest.mark.cuda
def test_graphs_off_decode_the_same_tokens(monkeypatch):
    e = engine()
    try:
        on = run_workload(e)
        assert e.device.graphs is not None and e.device.graphs.graphs
    finally:
        e.close()
    monkeypatch.setenv("LABKIT_CUDA_GRAPHS", "0")
    e = engine()
    try:
        assert e.device.graphs is None, "LABKIT_CUDA_GRAPHS=0 must turn the graphs off"
        assert run_workload(e) == on
    finally:
        e.close()


@pytest.mark.cuda
def test_a_failed_capture_runs_eager_and_logs_once(monkeypatch, caplog):
    e = engine()
    try:
        want = run_workload(e)
    finally:
        e.close()

    def broken_graph(*args, **kwargs):
        raise RuntimeError("capture refused (test)")
    monkeypatch.setattr(torch.cuda, "graph", broken_graph)
    e = engine()
    try:
        with caplog.at_level("WARNING", logger="labkit.device_cuda"):
            assert run_workload(e) == want  # every bucket eager, same tokens
            assert run_workload(e) == want
        failed = e.device.graphs.failed
        assert failed and not e.device.graphs.graphs
        logged = [r for r in caplog.records if "capture failed" in r.getMessage()]
        assert len(logged) == len(failed), "one warning per bucket, not one per step"
    finally:
        e.close()


@pytest.mark.cuda
def test_a_full_batch_is_graphed_in_a_bucket_of_max_seqs():
    e = engine(max_seqs=6)
    try:
        ids = [e.submit([4 + i], SamplingParams(max_new_tokens=5, ignore_eos=True))
               for i in range(6)]
        decoders.run(e, "pipelined")
        assert all(len(e.seqs[i].output_ids) == 5 for i in ids)
        batches = {b for b, _ in e.device.graphs.graphs}
        assert 6 in batches and not any(b > 6 for b in batches), (
            f"buckets {sorted(batches)}: 6 rows must run in a graph of 6 (min(bucket, max_seqs))")
    finally:
        e.close()


@pytest.mark.cuda
def test_close_frees_graphs_and_masks_and_can_be_called_twice():
    e = engine()
    run_workload(e)
    dev = e.device
    assert dev.graphs.graphs and len(dev._masks)
    e.close()
    assert not dev.graphs.graphs and dev.graphs.pool is None and len(dev._masks) == 0
    dev.close()


@pytest.mark.cuda
def test_mask_cache_is_keyed_by_content_and_bounded():
    cache = MaskCache(torch.device("cuda"), capacity=2)
    a = torch.zeros(40, dtype=torch.bool)
    a[3] = True
    same = a.clone()  # another object, the same bits: one upload
    assert cache.get(a) is cache.get(same) and len(cache) == 1
    for k in range(5):  # new contents push the oldest out
        m = torch.zeros(40, dtype=torch.bool)
        m[k + 10] = True
        got = cache.get(m)
        assert got.cpu().tolist() == m.tolist()
        del m  # its id may be reused by the next mask: the cache must not mistake them
    assert len(cache) == 2
