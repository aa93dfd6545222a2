"""The roofline's counts against hand counts, the presets' ridges, the measurements, the CLI."""
# ruff: noqa: E402 (the importorskip below comes before the imports that need it)

import json
import math
import subprocess
import sys
import time

import pytest

# a GPU image may lack a plotting package: the cuda test here must still run (gpu_check.sh)
matplotlib = pytest.importorskip("matplotlib")
import torch

from labkit import ceilings, claims, roofline
from labkit.cli import roofline_main as main
from labkit.instruments import roofline_plot
from labkit.model import LlamaModel, ModelConfig, init_random
from labkit.roofline import HARDWARE, step_cost

matplotlib.use("Agg")

TINY = ModelConfig.tiny()  # vocab 512, d 64, f 128, 2 layers, 4 heads / 2 KV heads of 16, tied

# Hand counts for TINY, written out once (bf16 = 2 bytes):
#   one layer's matmul weights: q 64*64 + k 64*32 + v 64*32 + o 64*64 = 12,288
#                               gate, up, down 3 * 64*128            = 24,576  -> 36,864
#   all weights read: 2 layers * (36,864 + 2 norms * 64) + final norm 64 + tied head 512*64
#                     = 106,816 values
#   a token's K and V: 2 (K, V) * 2 layers * 2 KV heads * 16 = 128 values
LAYER_MATMUL = 64 * 64 + 64 * 32 + 64 * 32 + 64 * 64 + 3 * 64 * 128
ALL_WEIGHTS = 2 * (LAYER_MATMUL + 2 * 64) + 64 + 512 * 64
KV_PER_TOKEN = 2 * 2 * 2 * 16
# activations a token's kernels read and write in one layer: q (64+64), k and v 2*(64+32),
# attention q in / o out (64+64), o (64+64), gate and up 2*(64+128), down (128+64)
ACT_PER_LAYER = 128 + 192 + 128 + 128 + 384 + 192


def test_layer_hand_count_is_what_the_config_says():
    assert LAYER_MATMUL == 36_864 and ALL_WEIGHTS == 106_816
    assert ALL_WEIGHTS == TINY.num_params()  # tied: the head is the embedding, counted once


def test_decode_step_of_tiny_matches_the_hand_count():
    c = step_cost(TINY, batch=2, context_len=10, phase="decode", weight_dtype="bf16",
                  kv_dtype="bf16", hardware="H100")
    assert c.tokens == 2
    assert c.linear_flops == 2 * 2 * 2 * LAYER_MATMUL  # 2 FLOPs x 2 tokens x 2 layers
    assert c.head_flops == 2 * 2 * 64 * 512  # 2 FLOPs x 2 rows x [64, 512]
    assert c.attention_flops == 4 * 2 * 10 * (4 * 16) * 2  # 4 x B x L x H*D x layers
    assert c.flops == 294_912 + 131_072 + 10_240
    assert c.weight_bytes == ALL_WEIGHTS * 2
    assert c.kv_read_bytes == 2 * 10 * KV_PER_TOKEN * 2  # every sequence's 10 tokens
    assert c.kv_write_bytes == 2 * 1 * KV_PER_TOKEN * 2  # one new token each
    # 2 tokens through 2 layers + their embedding rows; 2 head rows read h, write logits
    assert c.activation_bytes == (2 * (2 * ACT_PER_LAYER + 64) + 2 * (64 + 512)) * 2
    assert c.nbytes == 213_632 + 5_120 + 512 + 11_776


def test_prefill_step_of_tiny_matches_the_hand_count():
    c = step_cost(TINY, batch=1, context_len=4, phase="prefill", weight_dtype="bf16",
                  kv_dtype="bf16", hardware="H100")
    assert c.tokens == 4
    assert c.linear_flops == 2 * 4 * 2 * LAYER_MATMUL
    assert c.head_flops == 2 * 1 * 64 * 512  # only the last token's logits are computed
    # causal: token i attends over i + 1 keys: 1 + 2 + 3 + 4 = 10 (query, key) pairs
    assert c.attention_flops == 4 * 10 * 64 * 2
    assert c.kv_write_bytes == 4 * KV_PER_TOKEN * 2
    assert c.kv_read_bytes == c.kv_write_bytes  # read back at least once
    assert c.weight_bytes == ALL_WEIGHTS * 2  # the same weights as one decode step


def test_exercise_solutions_agree_with_step_cost():
    cfg = ModelConfig.smollm2_135m()
    c = step_cost(cfg, 8, 300, "decode", "int8", "fp8", hardware="H200")
    assert roofline.decode_step_flops(cfg, 8, 300) == c.flops
    assert roofline.decode_step_bytes(cfg, 8, 300, 1, 1) == \
        c.weight_bytes + c.kv_read_bytes + c.kv_write_bytes


def test_matmul_matvec_and_attention_intensity():
    # [2, 4] @ [4, 3]: 2 * 2*3*4 = 48 FLOPs; (8 + 12 + 6) elements * 2 bytes = 52 bytes
    assert roofline.matmul_intensity(2, 3, 4, 2) == 48 / 52
    op = roofline.matmul_cost(2, 3, 4, "bf16")
    assert (op.flops, op.nbytes) == (48, 52)
    # a matvec reads each weight once for 2 FLOPs: I -> 2 / bytes per element
    assert roofline.matvec_cost(8192, 8192, "bf16").intensity == pytest.approx(1.0, rel=1e-3)
    assert roofline.matvec_cost(8192, 8192, "fp32").intensity == pytest.approx(0.5, rel=1e-3)
    # decode attention reads each KV head once for its q_per_kv query heads: I -> 2 G / b_kv
    att = roofline.decode_attention_cost(ModelConfig.smollm2_135m(), 4, 100_000, "bf16")
    assert att.intensity == pytest.approx(2 * 3 / 2, rel=1e-3)


def test_preset_ridges_from_the_datasheets():
    # dense bf16 peak / bandwidth, each number typed here from the vendor's datasheet
    want = {"RTX3090": 71e12 / 936e9, "A100": 312e12 / 2.039e12, "H100": 989.5e12 / 3.35e12,
            "H200": 989.5e12 / 4.8e12, "B200": 2.25e15 / 8e12}
    assert set(HARDWARE) >= set(want)
    for name, ridge in want.items():
        assert HARDWARE[name].ridge("bf16") == pytest.approx(ridge, rel=1e-3), name
    # the H200 is an H100 with faster memory: same peak, lower ridge
    assert HARDWARE["H200"].peak("bf16") == HARDWARE["H100"].peak("bf16")
    assert HARDWARE["H200"].ridge() < HARDWARE["H100"].ridge()


def test_hardware_lookup_is_forgiving_and_errors_are_clear():
    assert HARDWARE["h200 sxm"] is HARDWARE["H200"] is roofline.get_hardware("H200-SXM")
    assert HARDWARE["rtx 3090"] is HARDWARE["RTX3090"]
    assert "a100 80gb sxm" in HARDWARE and "Z80" not in HARDWARE
    with pytest.raises(KeyError, match="presets: RTX3090"):
        HARDWARE["Z80"]
    with pytest.raises(KeyError, match="no fp4 peak"):
        HARDWARE["H100"].peak("fp4")
    with pytest.raises(ValueError, match="bandwidth"):
        roofline.Hardware("bad", {"bf16": 1.0}, 0.0, None, "", "", "")


def test_h100_bf16_critical_batch_is_about_295():
    h100 = HARDWARE["H100"]
    ridge = 989e12 / 3.35e12  # 295 FLOP/byte: a bf16 matmul does ~B FLOPs per weight byte
    assert h100.ridge("bf16") == pytest.approx(ridge, rel=0.005)
    # the smallest batch at which [B, 8192] @ [8192, 8192] is compute-bound on an H100
    first = next(b for b in range(1, 2000)
                 if roofline.matmul_cost(b, 8192, 8192, "bf16").bound(h100) == "compute")
    assert abs(first - ridge) / ridge < 0.1, first  # activation traffic moves it a few %
    # a 70B-class model at a short context: weights dominate the bytes, so decode also
    # turns compute-bound near the ridge
    big = ModelConfig("70b-like", vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                      num_layers=80, num_heads=64, num_kv_heads=8, head_dim=128)
    crit = step_cost(big, 1, 1, "decode", "bf16", "bf16", h100).critical_batch
    assert crit is not None and abs(crit - ridge) / ridge < 0.15, crit
    assert step_cost(big, crit, 1, "decode", "bf16", "bf16", h100).bound == "compute"
    assert step_cost(big, crit - 1, 1, "decode", "bf16", "bf16", h100).bound == "memory"


def test_decode_at_batch_1_is_memory_bound_on_every_preset():
    for name in HARDWARE:
        for cfg in (ModelConfig.smollm2_135m(), TINY):
            c = step_cost(cfg, 1, 1024, "decode", "bf16", "bf16", name)
            assert c.bound == "memory" and c.intensity < 2, (name, cfg.name, c.intensity)
            assert c.floor_s == pytest.approx(c.nbytes / HARDWARE[name].bandwidth)


def test_long_context_decode_never_turns_compute_bound():
    # SmolLM2 at 32k tokens: each sequence's KV (23 MB per 1k tokens) outweighs its FLOPs
    cfg = ModelConfig.smollm2_135m()
    c = step_cost(cfg, 1, 32768, "decode", "bf16", "bf16", "H100")
    assert c.critical_batch is None
    assert step_cost(cfg, 4096, 32768, "decode", "bf16", "bf16", "H100").bound == "memory"


def test_weight_dtype_and_bandwidth_move_the_floor():
    cfg = ModelConfig.smollm2_135m()
    bf16 = step_cost(cfg, 1, 1, "decode", "bf16", "bf16", "H200")
    int4 = step_cost(cfg, 1, 1, "decode", "int4", "bf16", "H200")
    assert int4.weight_bytes == bf16.weight_bytes / 4
    assert int4.compute_dtype == "bf16"  # weight-only: the matmuls still run in bf16
    b200 = step_cost(cfg, 1, 1, "decode", "bf16", "bf16", "B200")
    assert bf16.floor_s / b200.floor_s == pytest.approx(8 / 4.8)  # memory-bound: bandwidth
    with pytest.raises(ValueError, match="batch"):
        step_cost(cfg, 0, 1)
    with pytest.raises(ValueError, match="phase"):
        step_cost(cfg, 1, 1, "train")


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LABKIT_CACHE", str(tmp_path))
    monkeypatch.setattr(ceilings, "_CEILINGS", {})
    return tmp_path


def test_measure_ceilings_cpu_is_bounded_positive_and_cached(fresh_cache, monkeypatch):
    monkeypatch.setattr(claims, "busy_elsewhere", lambda since: 0.0)  # cache even if busy
    t0 = time.perf_counter()
    hw = ceilings.measure_ceilings("cpu", budget_s=1.0)
    took = time.perf_counter() - t0
    assert took < 1.0 + 3.0, f"measuring took {took:.1f} s for a 1 s budget"  # + allocation
    assert hw.name == "this machine (cpu)"
    assert hw.bandwidth > 1e8 and hw.memory > 1e8  # > 0.1 GB/s, > 100 MB: real numbers
    assert set(hw.peak_flops) == {"fp32", "bf16"} and min(hw.peak_flops.values()) > 1e7
    assert "copy" in hw.bandwidth_source and "matmul" in hw.flops_source
    assert ceilings.measure_ceilings("cpu", budget_s=1.0) is hw  # in-process cache
    files = list(fresh_cache.glob("ceilings-cpu-*.json"))
    assert len(files) == 1
    ceilings._CEILINGS.clear()
    monkeypatch.setattr(ceilings, "_quick_bandwidth", lambda dev: hw.bandwidth)  # as cached
    t0 = time.perf_counter()
    again = ceilings.measure_ceilings("cpu", budget_s=1.0)  # from disk, not measured again
    assert time.perf_counter() - t0 < 0.5 and again == hw


def test_a_cached_ceiling_the_memory_now_beats_is_measured_again(fresh_cache, monkeypatch):
    # a ceiling cached while a neighbour held the memory: later copies run clearly faster
    monkeypatch.setattr(claims, "busy_elsewhere", lambda since: 0.0)
    hw = ceilings.measure_ceilings("cpu", dtypes=("fp32",), budget_s=0.5)
    (path,) = fresh_cache.glob("ceilings-cpu-*.json")
    stale = json.loads(path.read_text()) | {"bandwidth": hw.bandwidth / 3}
    path.write_text(json.dumps(stale))
    ceilings._CEILINGS.clear()
    real = ceilings._quick_bandwidth(torch.device("cpu"))
    assert real > ceilings.STALE_BANDWIDTH * stale["bandwidth"], "the probe sees the memory"
    again = ceilings.measure_ceilings("cpu", dtypes=("fp32",), budget_s=0.5)
    assert again.bandwidth > ceilings.STALE_BANDWIDTH * stale["bandwidth"]
    assert json.loads(path.read_text())["bandwidth"] == again.bandwidth  # the file, replaced
    # one that holds: kept, not measured again
    ceilings._CEILINGS.clear()
    monkeypatch.setattr(ceilings, "_quick_bandwidth", lambda dev: again.bandwidth)
    monkeypatch.setattr(ceilings, "_measure_bandwidth", lambda *a: pytest.fail("re-measured"))
    assert ceilings.measure_ceilings("cpu", dtypes=("fp32",), budget_s=0.5) == again


def test_a_busy_machine_is_labelled_and_not_cached(fresh_cache, monkeypatch):
    monkeypatch.setattr(claims, "busy_elsewhere", lambda since: 1.5)
    hw = ceilings.measure_ceilings("cpu", dtypes=("fp32",), budget_s=0.5)
    assert "not cached" in hw.bandwidth_source
    assert not list(fresh_cache.glob("ceilings-*.json"))


@pytest.mark.cuda
@pytest.mark.measures_gpu
def test_measure_ceilings_cuda(fresh_cache):
    t0 = time.perf_counter()
    hw = ceilings.measure_ceilings("cuda", budget_s=2.0)
    assert time.perf_counter() - t0 < 2.0 + 5.0
    assert hw.name == "this machine (cuda)" and hw.bandwidth > 1e11  # > 100 GB/s
    assert hw.peak("bf16") > hw.peak("fp32") > 1e12  # tensor cores beat fp32 FMA units
    assert hw.memory > 1e9


def test_random_kv_attention_is_real_gqa_attention():
    gen = torch.Generator().manual_seed(0)
    attn = ceilings._RandomKVAttention(TINY, batch=3, context_len=7, dtype=torch.float32,
                                       device=torch.device("cpu"))
    q = torch.randn(3, 4, 16, generator=gen)  # [B, H, D]
    k, v = torch.randn(3, 2, 16, generator=gen), torch.randn(3, 2, 16, generator=gen)
    out = attn.attend(1, q, k, v)  # [B, H, D]
    # reference: query head h reads KV head h // 2; the new K, V sit in the last slot
    keys = attn.k[1].repeat_interleave(2, dim=1)  # [B, H, L, D]
    vals = attn.v[1].repeat_interleave(2, dim=1)
    assert torch.equal(attn.k[1][:, :, -1], k)
    scores = torch.einsum("bhd,bhld->bhl", q, keys) / math.sqrt(16)
    want = torch.einsum("bhl,bhld->bhd", scores.softmax(-1), vals)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)  # fp32 rounding only


def test_measure_decode_step_is_positive_and_bounded():
    model = init_random(LlamaModel(TINY)).eval()
    t0 = time.perf_counter()
    seconds = ceilings.measure_decode_step(model, batch=2, context_len=64, repeats=3)
    assert 0 < seconds < time.perf_counter() - t0 < 10


def test_plot_and_explorer_draw():
    import matplotlib.pyplot as plt

    hw = HARDWARE["H200"]
    points = [roofline_plot.RooflinePoint.timed(roofline.matvec_cost(1024, 1024), 1e-6, "matvec"),
              roofline.matmul_cost(4096, 4096, 4096),
              step_cost(TINY, 1, 128, hardware=hw)]
    ax = roofline_plot.plot_roofline([hw, "B200"], points)
    labels = [t.get_text() for t in ax.texts]
    assert "matvec" in labels and "decode B=1 L=128" in labels
    assert any(t.startswith("ridge 206") for t in labels)  # 989.5 / 4.8
    assert len(ax.get_legend().get_texts()) == 2  # one roof per chip
    plt.close("all")
    box = roofline_plot.explore("h100", "tiny")
    controls = [c for row in box.children[:-1] for c in row.children]
    batch = next(c for c in controls if getattr(c, "description", "") == "batch")
    batch.value = 64  # redraws; must not raise
    plt.close("all")


def _run(argv, capsys):
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_json_lines(capsys):
    code, out, err = _run(["--hardware", "H200", "--model", "smollm2-135m", "--batch",
                           "1,8,32,256", "--json"], capsys)
    assert code == 0 and err == ""
    rows = [json.loads(line) for line in out.splitlines()]
    assert [r["batch"] for r in rows] == [1, 8, 32, 256]
    for r in rows:
        assert {"batch", "phase", "flops", "bytes", "intensity", "floor_ms", "bound",
                "ridge"} <= set(r)
        assert r["phase"] == "decode" and r["bound"] in ("memory", "compute")
        assert r["intensity"] == pytest.approx(r["flops"] / r["bytes"])
        assert r["ridge"] == pytest.approx(989.5e12 / 4.8e12)
        assert r["floor_ms"] >= r["bytes"] / 4.8e12 * 1e3 * (1 - 1e-9)
    assert rows[0]["bound"] == "memory"
    intensities = [r["intensity"] for r in rows]
    assert intensities == sorted(intensities)  # batching shares the weights


def test_cli_table_prefill_and_this_machine(capsys, fresh_cache):
    code, out, _ = _run(["--hardware", "b200", "--phase", "prefill", "--context", "512",
                         "--batch", "1,4"], capsys)
    assert code == 0 and "B200" in out and "prefill" in out and "compute" in out
    code, out, err = _run(["--hardware", "this", "--batch", "1", "--json"], capsys)
    row = json.loads(out)  # stdout: the JSON line alone; the measuring's progress: stderr
    assert code == 0 and row["hardware"].startswith("this machine")
    assert "measuring this machine's ceilings" in err


@pytest.mark.parametrize("argv, message", [
    (["--hardware", "Z80"], "unknown hardware"),
    (["--batch", "0"], "--batch"),
    (["--batch", "1,x"], "--batch"),
    (["--batch", "1,,2"], "--batch"),
    (["--context", "0"], "--context"),
    (["--model", "gpt-5"], "unknown model"),
    (["--phase", "train"], "invalid choice"),
])
def test_cli_bad_input_exits_2_with_a_message(argv, message, capsys):
    code, out, err = _run(argv, capsys)
    assert code == 2 and out == "" and message in err


def test_cli_through_python_dash_m():
    ok = subprocess.run([sys.executable, "-m", "labkit", "roofline", "--hardware", "H100 SXM",
                         "--batch", "1,8192", "--context", "1", "--json"],
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    rows = [json.loads(line) for line in ok.stdout.splitlines()]
    assert [r["bound"] for r in rows] == ["memory", "compute"]
