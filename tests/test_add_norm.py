"""The fused residual add + RMSNorm kernel (models/add_norm.py) against the torch path's numerics (HF's), on CPU
through Triton's interpreter (conftest sets TRITON_INTERPRET=1 where there is no GPU; tests/test_gpu_kernels.py
runs it compiled)."""

from __future__ import annotations

import pytest
import torch

from models import add_norm, fp8
from models.ops import TORCH_KERNELS


def check_against_torch(rows: int, hidden: int, dtype: torch.dtype, device: str = "cpu") -> None:
    gen = torch.Generator().manual_seed(rows * 7 + hidden)
    x = (torch.randn(rows, hidden, generator=gen) * 3).to(dtype).to(device)
    residual = torch.randn(rows, hidden, generator=gen).to(dtype).to(device)
    weight = (torch.rand(hidden, generator=gen) + 0.5).to(dtype).to(device)
    ref_out, ref_res = TORCH_KERNELS.add_rms_norm(x.clone(), residual.clone(), weight, 1e-5)
    out, res = add_norm.add_rms_norm(x, residual, weight, 1e-5)
    assert out.data_ptr() == x.data_ptr() and res.data_ptr() == residual.data_ptr()  # in place, as flashinfer's
    assert torch.equal(res, ref_res)  # the sum, rounded once
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    else:  # two roundings apart at most: the RMS summed in another order can move the rounded normed row by one
        ulp = 2**-6 if dtype == torch.bfloat16 else 2**-9  # unit in its last place, and the product's rounding
        diff = (out.float() - ref_out.float()).abs()
        assert float((diff > 0).float().mean()) < 0.02
        assert torch.all(diff <= ref_out.float().abs() * ulp + 1e-6)


@pytest.mark.parametrize(("rows", "hidden"), [(1, 64), (5, 576), (3, 96), (1030, 40)])  # 1030: 4 rows a program
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])  # the interpreter rounds bf16 its own way
def test_matches_the_torch_path(rows, hidden, dtype):
    check_against_torch(rows, hidden, dtype)


def test_launch_shape_takes_one_row_a_program_for_decode_steps():
    assert add_norm.launch_shape(256, 576) == (1, 1024, 4)
    assert add_norm.launch_shape(16384, 4096) == (4, 4096, 8)
    assert add_norm.launch_shape(8, 64) == (1, 64, 1)


@pytest.mark.parametrize(("rows", "hidden"), [(5, 576), (1030, 40)])
def test_quantizing_variant_equals_the_unfused_kernel_then_the_quantizer(rows, hidden):
    """The FP8 variant writes the same residual and the same e4m3 values and scales as the unfused kernel then
    the quantiser; x stays as it was."""
    gen = torch.Generator().manual_seed(rows + hidden)
    x = (torch.randn(rows, hidden, generator=gen) * 3).to(torch.float16)
    residual = torch.randn(rows, hidden, generator=gen).to(torch.float16)
    weight = (torch.rand(hidden, generator=gen) + 0.5).to(torch.float16)
    ref_x, ref_residual = add_norm.add_rms_norm(x.clone(), residual.clone(), weight, 1e-5)
    before = x.clone()
    got, got_residual = add_norm.add_rms_norm_quantize(x, residual, weight, 1e-5)
    assert torch.equal(x, before)
    assert torch.equal(got_residual, ref_residual)
    assert got.values.shape == (rows, hidden) and got.dtype == torch.float16
    values, scale = fp8.quantize_rows(ref_x)
    assert torch.equal(got.scale, scale)
    assert torch.equal(got.values.view(torch.uint8), values.view(torch.uint8))
