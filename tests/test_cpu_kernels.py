"""labkit.cpu_kernels: the int8 kernel equals the dequantized reference, gives a row the same
result whatever rows share its call, and QuantLinear falls back to torch's kernel without it."""

import pytest
import torch

from labkit import cpu_kernels
from labkit.quant import QuantLinear, QuantScheme

built = cpu_kernels.kernels()
needs_kernel = pytest.mark.skipif(built is None,
                                  reason="no C++ compiler and ninja: the kernel cannot build")


def _int8_linear(n=200, k=100, bias=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.05
    b = torch.randn(n, generator=gen) if bias else None
    return QuantLinear.from_weight(w, QuantScheme.parse("int8"), b)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 3, 4, 7, 33])
@pytest.mark.parametrize("bias", [False, True])
def test_the_int8_kernel_equals_the_dequantized_reference(rows, bias):
    lin = _int8_linear(bias=bias)  # K = 100: 12 lanes of 8 and a tail of 4; N = 200: 66 x 3 + 2
    x = torch.randn(rows, lin.in_features, generator=torch.Generator().manual_seed(1))
    want = lin.reference(x)  # fp32 matmul of the dequantized weight
    got = lin(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # only the order of the sums
    assert lin(x[None]).shape == (1, rows, lin.out_features)  # leading dims kept


@needs_kernel
def test_a_rows_result_does_not_depend_on_the_rows_beside_it():
    # the pipelined decoder's zombie rows change how many rows a step has: each row's output
    # must be bit-identical whatever the count (each tile shape 4x3 .. 1x1 is exercised)
    lin = _int8_linear(n=8, k=100)  # blocks of 3, 3 and 2 weight rows
    x = torch.randn(11, lin.in_features, generator=torch.Generator().manual_seed(3))
    alone = torch.cat([lin(x[i:i + 1]) for i in range(11)])
    for m in (2, 3, 4, 5, 11):
        assert torch.equal(lin(x[:m]), alone[:m]), m


def test_without_the_kernel_quantlinear_uses_torchs(monkeypatch):
    lin = _int8_linear(k=128, bias=True)  # torch's int8 kernel wants K in whole blocks
    x = torch.randn(2, lin.in_features, generator=torch.Generator().manual_seed(2))
    monkeypatch.setitem(cpu_kernels._state, "module", None)
    got = lin(x)  # torch._weight_int8pack_mm: bf16 activations
    want = lin.reference(x)
    assert (got - want).abs().max() <= 0.01 * want.abs().max()
    if built is not None:  # a different path: the bf16 rounding of the activations shows
        monkeypatch.setitem(cpu_kernels._state, "module", built)
        assert not torch.equal(lin(x), got)


def test_the_kernel_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("LABKIT_CPU_KERNELS", "0")
    assert cpu_kernels._build() is None
