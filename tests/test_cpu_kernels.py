"""labkit.kernels.cpu: the int8 and int4 kernels equal the dequantized reference and give a row
the same result whatever rows share its call; QuantLinear falls back to torch's kernels without
them. Where the CPU has AVX512-VNNI, int4_linear_dot equals the reference on x held as int16.
The attention kernel writes k and v and attends as the naive reference does, and a token's
result does not depend on what else is in its step."""

import pytest
import torch

from labkit import model as model_mod
from labkit.attention import (
    AttentionMeta,
    FlashAttention,
    FlashMeta,
    NaiveAttention,
    PagedAttention,
)
from labkit.kernels import cpu as cpu_kernels
from labkit.model import ModelConfig, linear
from labkit.paged_kv import PagedKVCache
from labkit.quant import QuantLinear, QuantScheme

built = cpu_kernels.kernels()
needs_kernel = pytest.mark.skipif(built is None,
                                  reason="no C++ compiler and ninja: the kernel cannot build")
needs_int4_dot = pytest.mark.skipif(
    built is None or not built.has_int4_dot(),
    reason="this CPU has no AVX512-VNNI: int4_linear_dot is not built")


def _int8_linear(n=200, k=100, bias=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.05
    b = torch.randn(n, generator=gen) if bias else None
    return QuantLinear.from_weight(w, QuantScheme.parse("int8"), b)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 33])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("k", [100, 576])
def test_the_int8_kernel_equals_the_dequantized_reference(rows, bias, k):
    # K = 100: a block of 64 (or 12 lanes of 8) and a tail of 36 (4); N = 200: 33 x 6 + 2,
    # 66 x 3 + 2
    lin = _int8_linear(k=k, bias=bias)
    x = torch.randn(rows, lin.in_features, generator=torch.Generator().manual_seed(1))
    int16 = built.has_int8_dot()  # x held as int16 (AVX512-VNNI), else fp32 as it is
    xk = cpu_kernels.int8_x_as_int16(x) if int16 else x
    got = lin(x)
    # only the order of the sums: the fp32 matmul of the dequantized weight, on the x it used
    # (the int16 path's integer block sums are exact, so its tolerance is tight enough to
    # reject a rounding one level coarser, as the test below shows)
    tol = 2e-6 if int16 else 1e-5
    torch.testing.assert_close(got, lin.reference(xk), rtol=tol, atol=tol)
    # and within the int16 rounding's bound of the reference on x itself: each value moved at
    # most its block's amax / 65534, times the weights it meets
    moved = (xk - x).abs()
    amax = torch.cat([x[:, k0:k0 + 64].abs().amax(-1, keepdim=True).expand(-1, min(64, k - k0))
                      for k0 in range(0, k, 64)], dim=1)
    assert (moved <= amax / 65278 * 1.01).all()  # (and the fp32 rounding of code x scale)
    bound = moved @ lin.dequantized().abs().t() + 1e-5
    assert ((got - lin.reference(x)).abs() <= bound).all()
    assert lin(x[None]).shape == (1, rows, lin.out_features)  # leading dims kept


@needs_kernel
def test_the_int8_kernels_x_rounding_is_tested_by_a_wrong_one():
    # the reference rounding must be the kernel's: one level coarser (15-bit codes) is caught
    if not built.has_int8_dot():
        pytest.skip("this build multiplies x as fp32 (no AVX512-VNNI): nothing is rounded")
    lin = _int8_linear(k=576)
    x = torch.randn(3, 576, generator=torch.Generator().manual_seed(7))
    coarse = torch.cat([torch.round(x[:, k0:k0 + 64] * (16383 / m)) * (m / 16383) for k0 in
                        range(0, 576, 64) for m in [x[:, k0:k0 + 64].abs().amax(-1, True)]], 1)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(lin(x), lin.reference(coarse), rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(lin(x), lin.reference(cpu_kernels.int8_x_as_int16(x)),
                               rtol=2e-6, atol=2e-6)


@needs_kernel
def test_an_int8_block_of_near_zero_x_gives_near_zero_not_nan():
    # 32767 / amax overflows to inf for amax near FLT_MIN: such a block is held as zeros
    lin = _int8_linear(k=576)
    x = torch.randn(2, 576, generator=torch.Generator().manual_seed(9))
    x[0] = 1e-38  # every block of row 0 tiny (subnormal-adjacent), row 1 ordinary
    x[1, :64] = 0.0  # and an all-zero block
    y = lin(x)
    # zeros exactly (32767 / 1e-38 would be inf, and inf x turned into codes -32768)
    assert torch.equal(y[0], torch.zeros_like(y[0])) and y.isfinite().all()
    torch.testing.assert_close(y[1:], lin.reference(x[1:]), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(y, lin.reference(cpu_kernels.int8_x_as_int16(x)),
                               rtol=2e-6, atol=2e-6)


@needs_kernel
def test_a_nan_in_x_reaches_the_int8_kernels_outputs():
    lin = _int8_linear(k=576)
    x = torch.randn(2, 576, generator=torch.Generator().manual_seed(8))
    x[1, 100] = float("nan")
    y = lin(x)
    assert y[1].isnan().all() and not y[0].isnan().any()  # row 0 untouched by row 1's NaN


@needs_kernel
@pytest.mark.parametrize("k", [100, 576])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(k):
    # the pipelined decoder's zombie rows change how many rows a step has: each row's output
    # must be bit-identical whatever the count (each tile shape is exercised)
    lin = _int8_linear(n=8, k=k)  # blocks of 6 and 2, or of 3, 3 and 2 weight rows
    x = torch.randn(11, lin.in_features, generator=torch.Generator().manual_seed(3))
    alone = torch.cat([lin(x[i:i + 1]) for i in range(11)])
    for m in (2, 3, 4, 5, 11):
        assert torch.equal(lin(x[:m]), alone[:m]), m


needs_int8_dot = pytest.mark.skipif(built is None or not built.has_int8_dot(),
                                    reason="this CPU has no AVX512-VNNI: no int8_linear_dot")


def test_int8_dot_layout_puts_16_rows_side_by_side_and_gives_the_codes_back():
    q = torch.randint(-128, 128, (20, 100), dtype=torch.int8, generator=torch.Generator()
                      .manual_seed(4))
    packed = cpu_kernels.int8_dot_layout(q)
    assert packed.shape == (2, 2, 1024) and packed.dtype == torch.uint8
    assert torch.equal(cpu_kernels.int8_dot_codes(packed, 20, 100), q)
    held = packed.view(2, 2, 16, 16, 4).to(torch.int16) - 128  # [block, k/64, k-quad, row, 4]
    assert torch.equal(held[0, 0, 0, 1], q[1, :4].to(torch.int16))  # run 0: k 0..3 of each row
    assert torch.equal(held[0, 0, 1, 0], q[0, 4:8].to(torch.int16))  # run 1: k 4..7
    assert torch.equal(held[1, 1, 8, 3], q[19, 96:100].to(torch.int16))  # k 96..99, row 19
    assert not held[1, :, :, 4:].any() and not held[:, 1, 9:].any()  # zeros past N and K


@needs_int8_dot
@pytest.mark.parametrize("n,k", [(200, 100), (8, 576), (7, 64), (48, 1536), (33, 1000)])
def test_int8_linear_dot_gives_the_bits_int8_linear_gives(n, k):
    # the same integers (x's codes split in two bytes, the codes + 128, the offset taken off
    # a block at a time), each block's sum made fp32 and added in the same order: N = 200, 8,
    # 7, 33 end in a short block of rows, K = 100 and 1000 in a short block of k; every x
    # block holds a code at +-32639 (its amax), the widest split. Each row count: 1 row (its
    # own path), 2-4 in one tile, 5-11 in tiles of 4 and what is left, 9 and 11 with x's codes
    # made once and shared
    q, s = _int8_linear(n=n, k=k).canonical()[:2]
    packed = cpu_kernels.int8_dot_layout(q)
    x = torch.randn(11, k, generator=torch.Generator().manual_seed(5))
    x[3, :64] *= 1e6  # (rows of very different scales: each block its own)
    for m in (1, 2, 3, 4, 5, 8, 9, 11):
        assert torch.equal(built.int8_linear_dot(x[:m], packed, s),
                           built.int8_linear(x[:m], q, s)), m


@needs_int8_dot
def test_int8_linear_dot_refuses_a_layout_of_another_shape():
    q, s = _int8_linear(n=20, k=64).canonical()[:2]
    packed = cpu_kernels.int8_dot_layout(q)
    with pytest.raises(RuntimeError, match="int8_dot_layout"):
        built.int8_linear_dot(torch.randn(1, 128), packed, s)  # K = 128 needs 2 blocks of k
    with pytest.raises(RuntimeError, match="int8_dot_layout"):
        built.int8_linear_dot(torch.randn(1, 64), packed, s[:16])  # N = 16: one block, not 2
    with pytest.raises(RuntimeError, match="int8_dot_layout"):
        built.int8_linear_dot(torch.randn(1, 64), q, s)  # the codes as they are


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 13, 32])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("k", [100, 576])
def test_the_fp32_kernel_equals_torchs_linear(rows, bias, k):
    # K = 100: 8 lanes and a tail of 4; K = 576 (SmolLM2's): 16 lanes where AVX-512 is
    gen = torch.Generator().manual_seed(4)
    lin = torch.nn.Linear(k, 200, bias=bias)  # N = 200: 33 blocks of 6 + 2 rows
    x = torch.randn(rows, k, generator=gen)
    got = linear(lin, x)
    assert torch.equal(got, built.fp32_linear(x, lin.weight) + (lin.bias if bias else 0))
    torch.testing.assert_close(got, lin(x), rtol=1e-5, atol=1e-5)  # only the order of the sums


@needs_kernel
@pytest.mark.parametrize("k", [100, 576])
def test_an_fp32_rows_result_does_not_depend_on_the_rows_beside_it(k):
    # a speculative verify of k + 1 rows must score each position as a 1-row step would
    # 37 rows: one row of x reads them row after row (a run of rows a thread), more rows in
    # tiles of 6 and a tail of 1
    w = torch.randn(37, k, generator=torch.Generator().manual_seed(5))
    x = torch.randn(14, k, generator=torch.Generator().manual_seed(6))
    alone = torch.cat([built.fp32_linear(x[i:i + 1], w) for i in range(14)])
    for m in range(2, 15):  # tiles of 3 (or 4) x 6 and x 1, and their tails
        assert torch.equal(built.fp32_linear(x[:m], w), alone[:m]), m


@needs_kernel
def test_the_fp32_kernel_serves_few_rows_only_and_python_agrees_with_the_stack():
    assert model_mod._FP32_KERNEL_ROWS == built.FP32_KERNEL_ROWS  # the stack decides alike
    lin = torch.nn.Linear(64, 48, bias=False)
    x = torch.randn(built.FP32_KERNEL_ROWS + 1, 64)
    assert torch.equal(linear(lin, x), lin(x))  # a large step: torch's BLAS
    quant = _int8_linear(n=48, k=64)
    assert torch.equal(linear(quant, x[:2]), quant(x[:2]))  # not an fp32 nn.Linear: as it is
    seen = []
    lin.register_forward_hook(lambda m, a, out: seen.append(out.shape))
    linear(lin, x[:2])  # a hook on it (calibration): the module is called, so the hook runs
    assert seen == [(2, 48)]


def test_without_the_kernel_quantlinear_uses_torchs(monkeypatch):
    monkeypatch.setenv("LABKIT_INT8_DOT", "0")  # the codes as they are, which torch reads
    lin = _int8_linear(k=128, bias=True)  # torch's int8 kernel wants K in whole blocks
    x = torch.randn(2, lin.in_features, generator=torch.Generator().manual_seed(2))
    monkeypatch.setitem(cpu_kernels._state, "module", None)
    got = lin(x)  # torch._weight_int8pack_mm: bf16 activations
    want = lin.reference(x)
    assert (got - want).abs().max() <= 0.01 * want.abs().max()
    assert not torch.equal(got, want)  # (bf16 activations: not the fp32 reference)
    if built is not None:  # a different path: the bf16 rounding of the activations shows
        monkeypatch.setitem(cpu_kernels._state, "module", built)
        assert not torch.equal(lin(x), got)


@needs_int8_dot
def test_without_the_kernel_an_int8_linear_on_labkits_layout_takes_the_reference(monkeypatch):
    # torch has no op for labkit's layout: a torch mode (or no module) gets the dequantized
    # reference, which recovers the codes from the layout
    lin = _int8_linear(k=128, bias=True)
    assert lin._labkit_kernel == "int8_linear_dot"
    x = torch.randn(2, lin.in_features, generator=torch.Generator().manual_seed(2))
    monkeypatch.setitem(cpu_kernels._state, "module", None)
    assert torch.equal(lin(x), lin.reference(x))


def _int4_linear(n=203, k=96, spec="int4-g32", bias=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.05
    b = torch.randn(n, generator=gen) if bias else None
    return QuantLinear.from_weight(w, QuantScheme.parse(spec), b)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 33])
@pytest.mark.parametrize("spec,k", [("int4-g32", 96), ("int4-g32", 224), ("int4-g64", 192),
                                    ("int4-g128", 256)])  # K = 224: 7 groups, an odd count
def test_the_int4_kernel_equals_the_dequantized_reference(rows, spec, k):
    # N = 203: blocks of 4 (one row of x), 2 (two or three) and 3 (four and more) all end short
    lin = _int4_linear(k=k, spec=spec, bias=rows == 3)
    assert lin.kscale.dtype == torch.int32  # labkit's layout (cpu_kernels.int4_layout)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(lin(x), lin.reference(x), rtol=1e-5, atol=1e-5)
    assert lin(x[None]).shape == (1, rows, lin.out_features)  # leading dims kept


@needs_kernel
@pytest.mark.parametrize("kernel,n", [("int4_linear", 11),
                                      pytest.param("int4_linear_dot", 48, marks=needs_int4_dot)])
def test_an_int4_rows_result_does_not_depend_on_the_rows_beside_it(kernel, n, monkeypatch):
    # int4_linear: one row, two or three, and four or more take different paths (codes
    # dequantized in registers, or once into an L1 buffer); int4_linear_dot: up to 3 rows take
    # a pair of blocks of 16 output rows at once (one row with four sums each, two or three
    # with two), more rows a block at a time, chunks of up to 6 rows sharing each code vector;
    # n = 48 ends with a block alone. Every row's output must be bit-identical.
    if kernel == "int4_linear":
        monkeypatch.setenv("LABKIT_INT4_DOT", "0")
    lin = _int4_linear(n=n, k=96)
    assert lin._labkit_kernel == kernel
    x = torch.randn(19, 96, generator=torch.Generator().manual_seed(3))
    alone = torch.cat([lin(x[i:i + 1]) for i in range(19)])
    for m in (2, 3, 4, 5, 6, 7, 8, 9, 11, 16, 17, 19):
        assert torch.equal(lin(x[:m]), alone[:m]), (kernel, m)


@needs_kernel
def test_the_int4_kernel_refuses_operands_it_cannot_read():
    lin = _int4_linear()
    x = torch.randn(2, 96)
    with pytest.raises(RuntimeError, match="int4_linear"):
        built.int4_linear(x[:, :80].contiguous(), lin.kweight, lin.kscale)  # K disagrees
    with pytest.raises(RuntimeError, match="int4_linear"):
        built.int4_linear(x, lin.kweight, lin.kscale.float())  # not the int32 layout


def test_without_the_kernel_int4_uses_torchs_layout_and_kernel(monkeypatch):
    monkeypatch.setitem(cpu_kernels._state, "module", None)
    lin = _int4_linear(n=64, k=128, bias=True)  # built now: torch's layout (N % 16 == 0)
    assert lin.kscale.dtype == torch.bfloat16
    x = torch.randn(2, 128, generator=torch.Generator().manual_seed(2))
    want = lin.reference(x)
    assert (lin(x) - want).abs().max() <= 0.01 * want.abs().max()


@needs_kernel
def test_relayout_derives_the_layout_again_for_where_the_codes_are(monkeypatch):
    # after model.to(device) the layout must be rebuilt (the CUDA device does it): here, the
    # same codes go from labkit's layout to torch's when labkit's kernel stops being there
    from labkit.quant import relayout

    lin = _int4_linear(n=64, k=128)
    x = torch.randn(2, 128, generator=torch.Generator().manual_seed(5))
    assert lin._labkit_kernel in ("int4_linear", "int4_linear_dot")  # one of labkit's layouts
    assert lin.kscale.dtype == torch.int32
    monkeypatch.setitem(cpu_kernels._state, "module", None)
    assert relayout(torch.nn.Sequential(lin))[0] is lin
    assert lin.kscale.dtype == torch.bfloat16 and lin._labkit_kernel is None
    want = lin.reference(x)
    assert (lin(x) - want).abs().max() <= 0.01 * want.abs().max()


@needs_kernel
def test_under_a_torch_mode_int4_runs_the_reference_path():
    # labkit's int4 layout has no torch op to fall back on: a mode gets the dequantized matmul
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Seen(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    lin = _int4_linear()
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(4))
    with Seen():
        got = lin(x)
    assert any("mm" in f for f in seen)  # the matmul was an aten op the mode saw
    torch.testing.assert_close(got, lin.reference(x))
    torch.testing.assert_close(lin(x), got, rtol=1e-5, atol=1e-5)  # the kernel, outside it


# ---- int4_linear_dot (AVX512-VNNI CPUs) -----------------------------------------------------

@pytest.mark.parametrize("n", [48, 64])  # 3 blocks (a pair, then one alone), 4 (two pairs)
def test_the_dot_layout_holds_every_code_where_the_kernel_reads_it(n):
    # runs on every CPU: the layout is plain torch; read it back as its docstring says
    gen = torch.Generator().manual_seed(7)
    k, g = 128, 32
    ng, nb = k // g, n // 16
    codes = torch.randint(0, 16, (n, k), generator=gen)
    scale = torch.rand(n, k // g, generator=gen).bfloat16().float()
    zero = torch.randn(n, k // g, generator=gen).bfloat16().float()
    packed = cpu_kernels.int4_dot_layout(codes, scale, zero)
    assert packed.shape == (nb, ng, 8 * g + 64) and packed.dtype == torch.uint8
    flat = packed.reshape(-1)

    def run(blk: int, group: int) -> tuple[int, int]:
        """(where block `blk`'s codes for `group` start, where its 16 words start)"""
        pair, second = divmod(blk, 2)
        alone = nb % 2 and blk == nb - 1
        blocks = 1 if alone else 2
        start = pair * 2 * ng * (8 * g + 64) + group * blocks * (8 * g + 64)
        return start + second * 8 * g, start + blocks * 8 * g + second * 64

    for blk, u, i, e in [(0, 0, 0, 0), (1, 5, 3, 1), (nb - 1, 15, 15, 3), (nb - 1, 7, 9, 2),
                         (nb - 2, 9, 4, 0)]:
        at, _ = run(blk, u * 8 // g)
        byte, row = int(flat[at + (u % (g // 8)) * 64 + 4 * i + e]), 16 * blk + i
        assert byte & 15 == codes[row, 8 * u + e] and byte >> 4 == codes[row, 8 * u + 4 + e]
    bf = lambda v: torch.tensor([v], dtype=torch.int32).to(torch.int16).view(  # noqa: E731
        torch.bfloat16).float()  # (bits 0..65535 as int16's two's complement)
    for blk, group, i in [(1, 2, 4), (nb - 1, 3, 15), (0, 0, 0), (nb - 2, 1, 7)]:
        _, at = run(blk, group)
        word = int(flat[at + 4 * i:at + 4 * i + 4].view(torch.int32))
        assert bf(word & 0xFFFF) == scale[16 * blk + i, group]  # the low half
        assert bf((word >> 16) & 0xFFFF) == zero[16 * blk + i, group]  # the high half
    back = cpu_kernels.int4_dot_codes(packed)
    assert torch.equal(back[0].long(), codes) and torch.equal(back[1], scale)
    assert torch.equal(back[2], zero)


def test_the_dot_kernels_x_is_a_power_of_two_steps_within_a_step_of_x():
    # runs on every CPU: the reference of what int4_linear_dot multiplies
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(5, 96, generator=gen) * torch.tensor([1e-3, 1.0, 7.0, 300.0, 1e5])[:, None]
    got = cpu_kernels.int4_x_as_int16(x, 32)
    for row in range(5):
        for g in range(3):
            v, q = x[row, 32 * g:32 * g + 32], got[row, 32 * g:32 * g + 32]
            s = float(cpu_kernels.int4_x_scale(v.abs().amax()))
            assert s == 2.0 ** round(torch.tensor(s).log2().item())  # a power of two
            assert float(v.abs().amax()) / s <= 32639 < 2 * float(v.abs().amax()) / s  # least
            codes = q / s
            assert torch.equal(codes, codes.round()) and codes.abs().max() <= 32639
            assert float((q - v).abs().max()) <= s / 2  # the nearest step
    assert got[:, :32].isfinite().all()
    x[0, 3] = float("nan")
    assert cpu_kernels.int4_x_as_int16(x, 32)[0, :32].isnan().all()  # a NaN reaches its group
    assert cpu_kernels.int4_x_as_int16(x, 32)[0, 32:].isfinite().all()  # and only it
    assert not cpu_kernels.int4_x_as_int16(torch.full((1, 32), 1e-31), 32).any()  # (tiny: zeros)


@needs_int4_dot
@pytest.mark.parametrize("rows", [1, 2, 3, 6, 7, 13, 33])
@pytest.mark.parametrize("spec,n,k", [("int4-g32", 48, 96), ("int4-g64", 32, 192),
                                      ("int4-g128", 64, 256), ("int4-g32", 960, 576)])
def test_the_dot_kernel_equals_the_reference_on_int16_activations(rows, spec, n, k):
    lin = _int4_linear(n=n, k=k, spec=spec)
    g = lin.group_size
    assert lin._labkit_kernel == "int4_linear_dot" and lin.kweight.shape == (n // 16, k // g,
                                                                            8 * g + 64)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=gen) * torch.rand(1, k, generator=gen) * 4
    got = lin(x)
    held = cpu_kernels.int4_x_as_int16(x, lin.group_size)
    want = (held.double() @ lin.dequantized().double().t()).float()  # what the kernel sums
    assert float((got - want).abs().max()) <= 1e-6 * float(want.abs().max()), spec
    exact = lin.reference(x)  # fp32 x: the int16 steps (<= 2^-15 of a group's largest) left
    assert float((got - exact).abs().max()) <= 2e-4 * float(exact.abs().max()), spec
    # finer than x rounded to bf16 (2^-9 relative), torch's kernels' and the former kernel's
    bf16 = (x.bfloat16().double() @ lin.dequantized().double().t()).float()
    assert (got - exact).abs().max() < (bf16 - exact).abs().max()


@needs_int4_dot
def test_the_dot_kernel_reads_back_each_weight_exactly():
    # a 1 alone in its group: scale 2^-14, code 16384, and every product exact
    lin = _int4_linear(n=64, k=128)
    assert torch.equal(lin(torch.eye(128)).t(), lin.dequantized())


@needs_int4_dot
def test_a_nan_in_x_reaches_the_outputs_as_an_fp32_product_would():
    lin = _int4_linear(n=48, k=96)
    x = torch.randn(2, 96, generator=torch.Generator().manual_seed(12))
    x[0, 40] = float("nan")
    y = lin(x)
    assert y[0].isnan().all() and y[1].isfinite().all()


@needs_int4_dot
def test_the_dot_kernel_refuses_operands_it_cannot_read():
    lin = _int4_linear(n=48, k=96)
    x = torch.randn(2, 96)
    with pytest.raises(RuntimeError, match="int4_linear_dot"):
        built.int4_linear_dot(torch.randn(2, 64), lin.kweight)  # K disagrees
    with pytest.raises(RuntimeError, match="int4_linear_dot"):
        built.int4_linear_dot(x, lin.kweight.reshape(3, -1))  # not its [N/16, K/G, 8G + 64]
    with pytest.raises(RuntimeError, match="int4_linear_dot"):
        built.int4_linear_dot(x, lin.kweight.view(torch.int8))  # not bytes
    with pytest.raises(RuntimeError, match="int4_linear_dot"):
        built.int4_linear_dot(x, lin.kweight[:, :, :-64])  # no scales (G would not be whole)
    with pytest.raises(RuntimeError, match="int4_linear_dot"):
        built.int4_linear_dot(x.double(), lin.kweight)  # not fp32
    assert built.int4_linear_dot(x[:0], lin.kweight).shape == (0, 48)  # no rows: none out


@needs_kernel
def test_labkit_int4_dot_0_keeps_the_fp32_int4_kernel(monkeypatch):
    monkeypatch.setenv("LABKIT_INT4_DOT", "0")
    lin = _int4_linear(n=48, k=96)
    assert lin._labkit_kernel == "int4_linear" and lin.kscale.shape == (48, 3)
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(6))
    torch.testing.assert_close(lin(x), lin.reference(x), rtol=1e-5, atol=1e-5)


def test_without_vnni_the_dot_kernel_is_never_chosen(monkeypatch):
    class NoDot:
        def has_int4_dot(self):
            return False

    monkeypatch.setitem(cpu_kernels._state, "module", NoDot())
    scale = torch.ones(48, 3)
    assert not cpu_kernels.int4_dot_fits(48, 96, 32, scale, scale)


def test_a_compiler_without_avx512_vnni_still_builds_the_other_kernels(monkeypatch):
    # a CPU with AVX512-VNNI: its build is named for what it has, and a compiler that cannot
    # build it still gets the AVX2 one
    tried = []

    def build_with(flags):
        tried.append(flags)
        variant = cpu_kernels._state["variant"] = (
            "avx512vnni" if "-mavx512vnni" in flags else "avx2")
        return None if variant == "avx512vnni" else "the avx2 module"

    monkeypatch.setattr(cpu_kernels, "_flags", lambda: ["-mavx2", "-mfma", "-mavx512f",
                                                        "-mavx512bw", "-mavx512vnni"])
    monkeypatch.setattr(cpu_kernels, "_build_with", build_with)
    monkeypatch.setattr(cpu_kernels.shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setitem(cpu_kernels._state, "variant", None)
    assert cpu_kernels._build() == "the avx2 module"
    assert tried == [["-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512vnni"],
                     ["-mavx2", "-mfma"]]


def test_a_build_is_named_for_its_vector_flags(monkeypatch):
    names = []

    def build_extension(name, *a, **kw):
        names.append(name)
        return "built"

    monkeypatch.setattr(cpu_kernels, "build_extension", build_extension)
    monkeypatch.setitem(cpu_kernels._state, "variant", None)
    for flags in (["-mavx2", "-mfma", "-mavx512f", "-mavx512vnni"], ["-mavx2", "-mfma"], []):
        cpu_kernels._build_with(flags)
    assert names == ["labkit_kernels_avx512vnni", "labkit_kernels_avx2", "labkit_kernels_generic"]


def test_the_kernel_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("LABKIT_CPU_KERNELS", "0")
    assert cpu_kernels._build() is None


# ---- paged_attention ------------------------------------------------------------------------

def _pool_step(cfg, starts, qlens, block=4, seed=0, meta_type=AttentionMeta):
    """A pool holding each sequence's cached context on scattered pages, and a step's inputs
    (its metadata a `meta_type`: AttentionMeta, or FlashMeta for FlashAttention)."""
    gen = torch.Generator().manual_seed(seed)
    pages = [-(-(s + q) // block) for s, q in zip(starts, qlens)]
    perm = torch.randperm(sum(pages) + 3, generator=gen).tolist()
    tables, at = [], 0
    for n in pages:
        tables.append(perm[at:at + n] + [0] * (max(pages) - n))
        at += n
    cache = PagedKVCache(cfg, sum(pages) + 3, block)
    cache.cfg = cfg  # for _attend's copy
    cache.k.normal_(generator=gen)
    cache.v.normal_(generator=gen)
    t = sum(qlens)
    q = torch.randn(t, cfg.num_heads, cfg.head_dim, generator=gen)
    k = torch.randn(t, cfg.num_kv_heads, cfg.head_dim, generator=gen)
    v = torch.randn(t, cfg.num_kv_heads, cfg.head_dim, generator=gen)
    meta = meta_type.build(torch.tensor(qlens), torch.tensor(starts), torch.tensor(tables),
                           block)
    return cache, meta, q, k, v


def _attend(backend_cls, cache, meta, q, k, v, **kw):
    store = PagedKVCache(cache.cfg, cache.num_blocks, cache.block_size)  # a copy: writes land
    store.cfg = cache.cfg
    store.k.copy_(cache.k)
    store.v.copy_(cache.v)
    attn = backend_cls(store, **kw)
    attn.begin_step(meta)
    return attn.attend(0, q, k, v), store


@needs_kernel
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 2, 16), (5, 1, 20),
                                                     (8, 2, 72), (4, 2, 40), (6, 3, 48)])
def test_paged_attention_in_place_equals_the_naive_reference(heads, kv_heads, head_dim):
    # head groups of 3, 2, 5 (3 + 2) and 4 (3 + 1); head widths of 1 to 4 runs of 16 lanes,
    # with 8-lane and scalar tails and none
    cfg = ModelConfig.tiny().with_(num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim)
    cache, meta, q, k, v = _pool_step(cfg, starts=[0, 9, 4, 30], qlens=[7, 1, 3, 1])
    want, want_store = _attend(NaiveAttention, cache, meta, q, k, v)
    got, store = _attend(PagedAttention, cache, meta, q, k, v)
    assert torch.equal(store.k, want_store.k) and torch.equal(store.v, want_store.v)  # writes
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    gathered, _ = _attend(PagedAttention, cache, meta, q, k, v, cpu_kernel=False)
    torch.testing.assert_close(got, gathered, rtol=1e-5, atol=1e-5)


@needs_kernel
def test_a_tokens_attention_does_not_depend_on_what_shares_its_step():
    # the same decode token, alone and beside a prefill chunk and other decodes: bit-equal;
    # and a prompt's last token in one whole prefill or as a chunk of its own: bit-equal
    cfg = ModelConfig.smollm2_135m().with_(num_layers=1)
    cache, meta, q, k, v = _pool_step(cfg, starts=[40, 0, 17], qlens=[1, 12, 1], seed=5)
    together, _ = _attend(PagedAttention, cache, meta, q, k, v)
    solo = AttentionMeta.build(torch.tensor([1]), torch.tensor([40]), meta.ctx_slots[:1, :1]
                               .new_tensor([_table(cache, meta, 0)]), cache.block_size)
    alone, _ = _attend(PagedAttention, cache, solo, q[:1], k[:1], v[:1])
    assert torch.equal(alone[0], together[0])
    # the prompt of row 1: tokens 0..10 already cached (written by the step above), token 11 now
    _, written = _attend(PagedAttention, cache, meta, q, k, v)
    chunk = AttentionMeta.build(torch.tensor([1]), torch.tensor([11]),
                                torch.tensor([_table(cache, meta, 1)]), cache.block_size)
    last, _ = _attend(PagedAttention, written, chunk, q[12:13], k[12:13], v[12:13])
    assert torch.equal(last[0], together[12])


@needs_kernel
def test_a_decode_tokens_flash_attention_does_not_depend_on_what_shares_its_step():
    # a decode token's tiles beside many others' (the threads dealt each (token, tile)'s KV
    # heads together) and alone (each (tile, KV head) dealt on its own): bit-equal
    cfg = ModelConfig.smollm2_135m().with_(num_layers=1)
    starts, qlens = [40, 0, 17, 300, 5], [1, 12, 1, 1, 1]
    cache, meta, q, k, v = _pool_step(cfg, starts, qlens, seed=7, meta_type=FlashMeta)
    together, _ = _attend(FlashAttention, cache, meta, q, k, v, tile_tokens=16)
    for b, t in ((0, 0), (3, 14)):  # q rows: sequence 0's token, sequence 3's
        solo = FlashMeta.build(torch.tensor([1]), torch.tensor([starts[b]]),
                               meta.block_tables[b:b + 1], cache.block_size)
        alone, _ = _attend(FlashAttention, cache, solo, q[t:t + 1], k[t:t + 1], v[t:t + 1],
                           tile_tokens=16)
        assert torch.equal(alone[0], together[t]), b
    want, _ = _attend(NaiveAttention, cache, _pool_step(cfg, starts, qlens, seed=7)[1], q, k, v)
    torch.testing.assert_close(together, want, rtol=1e-5, atol=1e-5)


def _table(cache, meta, b):
    """Row b's block table, read back from its context slots."""
    n = int(meta.ctx_lens[b])
    return [int(s) // cache.block_size for s in meta.ctx_slots[b, :n:cache.block_size]]


@needs_kernel
def test_paged_attention_refuses_a_slot_outside_the_pool():
    cfg = ModelConfig.tiny()
    cache, meta, q, k, v = _pool_step(cfg, starts=[3], qlens=[1])
    meta.ctx_slots[0, 0] = cache.num_slots  # one past the end
    with pytest.raises(RuntimeError, match="slot outside the pool"):
        _attend(PagedAttention, cache, meta, q, k, v)


# ---- the small per-row ops ------------------------------------------------------------------

def _torch_path(monkeypatch, fn, *args):
    """fn(*args) with labkit's kernels out of the way: the model's torch ops."""
    with monkeypatch.context() as m:
        m.setitem(cpu_kernels._state, "module", None)
        return fn(*args)


@needs_kernel
@pytest.mark.parametrize("rows,d", [(1, 576), (5, 64), (3, 20)])
def test_rms_norm_rope_and_silu_mul_equal_the_torch_ops(monkeypatch, rows, d):
    from torch.nn import functional as F

    from labkit.model import apply_rope, rms_norm, rope_tables, silu_mul
    gen = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, d, generator=gen) * 3, torch.randn(d, generator=gen)
    torch.testing.assert_close(rms_norm(x, w, 1e-5),
                               _torch_path(monkeypatch, rms_norm, x, w, 1e-5))
    qkv = torch.randn(rows, 7, d, generator=gen)  # rope on a view: the first 5 heads
    cos, sin = rope_tables(d, 1e4, torch.arange(rows) * 37)
    got = apply_rope(qkv[:, :5], cos, sin)
    torch.testing.assert_close(got, _torch_path(monkeypatch, apply_rope, qkv[:, :5], cos, sin))
    gu = torch.randn(rows, 2 * d, generator=gen) * 4
    gate, up = gu.chunk(2, dim=-1)  # views with a row stride of 2d
    torch.testing.assert_close(silu_mul(gate, up), F.silu(gate) * up)


@needs_kernel
@pytest.mark.parametrize("d", [6, 20, 64])
def test_rope_is_each_elements_two_products_and_their_sum(d):
    # out[i] = x[i] cos[i] + x[(i + D/2) % D] sin[i] (the signed sin table), one rounding each
    from labkit.model import rope_tables
    gen = torch.Generator().manual_seed(d)
    x = torch.randn(3, 7, d, generator=gen)[:, :5]  # a view, as the stack's of q|k|v
    cos, sin = rope_tables(d, 1e4, torch.arange(3) * 37)
    partner = torch.cat([x[..., d // 2:], x[..., :d // 2]], dim=-1)
    assert torch.equal(built.rope(x, cos, sin), x * cos + partner * sin)


@needs_kernel
@pytest.mark.parametrize("rows,d", [(1, 576), (5, 64), (3, 20)])
def test_add_rms_norm_is_the_add_then_the_norm_bit_for_bit(rows, d):
    # the decoder stack's residual add and the norm after it, in one call
    gen = torch.Generator().manual_seed(rows)
    x, r, w = (torch.randn(rows, d, generator=gen) * 3, torch.randn(rows, d, generator=gen),
               torch.randn(d, generator=gen))
    want_s = x + r
    want_y = built.rms_norm(want_s, w, 1e-5)
    before = x.clone()
    s, y = built.add_rms_norm(x, r, w, 1e-5, False)  # a new sum: x untouched
    assert torch.equal(s, want_s) and torch.equal(y, want_y) and torch.equal(x, before)
    assert s.data_ptr() != x.data_ptr()
    s, y = built.add_rms_norm(x, r, w, 1e-5, True)  # in place: the sum is x itself
    assert s.data_ptr() == x.data_ptr() and torch.equal(x, want_s) and torch.equal(y, want_y)
    with pytest.raises(RuntimeError, match="add_rms_norm"):
        built.add_rms_norm(x, r[:, :-1].contiguous(), w, 1e-5, False)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_rope_rows_from_the_table_are_the_formulas_values(monkeypatch, threads):
    # the CPU table (built in small calls, then indexed) gives each position exactly what the
    # formula gives it, for one row, a few, a long prefill, and past the table's first end
    from labkit import model as model_mod
    monkeypatch.setattr(model_mod, "_ROPE_ROWS", {})
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for positions in (torch.tensor([0]), torch.tensor([5, 1023, 7]), torch.arange(3000),
                          torch.tensor([70_000, 3])):
            for d, theta in ((64, 1e5), (16, 1e4)):
                got = model_mod.rope_tables(d, theta, positions)
                want = model_mod._rope_formula(d, theta, positions)
                assert got[0].shape == want[0].shape == (len(positions), 1, d)
                assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert model_mod._ROPE_ROWS[(64, 1e5)][0].shape[0] == 1 << 17  # doubled to cover 70,000
        with pytest.raises(ValueError, match="negative position -1"):
            model_mod.rope_tables(64, 1e5, torch.tensor([3, -1]))
    finally:
        torch.set_num_threads(before)


@needs_kernel
def test_the_kernels_stand_aside_while_a_torch_mode_is_on():
    # a pybind call is invisible to a dispatch trace (and to tests' fake CUDA graphs)
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    x = torch.randn(2, 8)
    assert cpu_kernels.usable(x) is built
    assert cpu_kernels.usable(x.double()) is None
    with Seen():
        assert cpu_kernels.usable(x) is None


# ---- read_probe: bench step's yardstick -------------------------------------------------------

@needs_kernel
@pytest.mark.parametrize("nbytes", [0, 255, 256, 4096 + 77, 1_000_003])
def test_the_read_probe_reads_every_byte(nbytes):
    # what it returns is its proof of reading: the xor of the buffer's 8-byte words over whole
    # 256-byte steps, then of each tail byte; a byte it skipped would not change the answer
    import numpy as np

    gen = torch.Generator().manual_seed(nbytes)
    buf = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    whole = nbytes - nbytes % 256
    want = int(np.bitwise_xor.reduce(buf[:whole].numpy().view(np.uint64), initial=0))
    for b in buf[whole:].tolist():
        want ^= b
    assert built.read_probe(buf) & (2**64 - 1) == want
    for i in {0, nbytes // 2, nbytes - 1} if nbytes else ():  # first, middle, last byte
        flipped = buf.clone()
        flipped[i] ^= 1
        assert built.read_probe(flipped) != built.read_probe(buf), i


@needs_kernel
@pytest.mark.parametrize("width", [1, 5, 63, 64, 100, 49152])
def test_argmax_rows_is_torchs_argmax(width):
    # the first index of each row's largest value, a NaN the largest (its first one): ties,
    # NaNs, infinities, signed zeros, rows shorter than a vector and a SmolLM2 row
    gen = torch.Generator().manual_seed(width)
    cases = [torch.randn(3, width, generator=gen),
             torch.randint(-2, 2, (3, width), generator=gen).float(),  # ties everywhere
             torch.full((2, width), float("-inf")),
             torch.zeros(2, width)]
    cases[3][:, width // 2:] = -0.0
    nan = torch.randn(4, width, generator=gen)
    nan[0, width // 2] = float("nan")
    nan[1][torch.rand(width, generator=gen) < 0.3] = float("nan")
    nan[2, -1] = float("inf")
    cases.append(nan)
    for x in cases:
        assert torch.equal(built.argmax_rows(x), x.argmax(dim=-1)), x
