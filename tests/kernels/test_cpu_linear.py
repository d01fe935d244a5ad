"""linear_rows_cpu / gated_rows_cpu (the products of few rows) against their torch references."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_paged_cache.kernels import cpu_attention
from hf_paged_cache.kernels.cpu_linear import gated_rows_cpu, gated_rows_ref, linear_rows_cpu, linear_rows_ref

pytestmark = pytest.mark.skipif(not cpu_attention.available(),
                                reason="the C++ CPU kernels could not be built here")  # fmt: skip


@st.composite
def products(draw):
    """Rows of every tile height and remainder (up to past the few-rows bound), inputs of whole vectors, a remainder or
    less than one, outputs of whole tiles and a remainder, with or without a bias and a residual."""
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    rows, k, n = draw(st.integers(1, 70)), draw(st.sampled_from([3, 16, 37, 64, 576])), draw(st.integers(1, 13))
    shape = (1, rows, k) if draw(st.booleans()) else (rows, k)
    x = torch.randn(*shape, generator=generator)
    weight, bias = torch.randn(n, k, generator=generator) / k**0.5, torch.randn(n, generator=generator)
    residual = torch.randn(*shape[:-1], n, generator=generator)
    return x, weight, bias if draw(st.booleans()) else None, residual if draw(st.booleans()) else None


@settings(max_examples=60, deadline=None)
@given(products())
def test_linear_rows_cpu_is_torchs_linear_plus_the_residual(product):
    x, weight, bias, residual = product
    out = linear_rows_cpu(x, weight, bias, residual)
    assert out.shape == (*x.shape[:-1], weight.shape[0])
    torch.testing.assert_close(out, linear_rows_ref(x, weight, bias, residual), rtol=1e-5, atol=1e-5)


@settings(max_examples=40, deadline=None)
@given(products(), st.booleans(), st.integers(0, 2**16))
def test_gated_rows_cpu_is_the_llama_mlps_hidden_state(product, biased, seed):
    x, gate, bias, _residual = product
    generator = torch.Generator().manual_seed(seed)
    up = torch.randn(gate.shape, generator=generator) / gate.shape[1] ** 0.5  # scaled as the gate's
    up_bias = torch.randn(gate.shape[0], generator=generator) if bias is not None and biased else None
    out = gated_rows_cpu(x, gate, up, bias, up_bias)
    torch.testing.assert_close(out, gated_rows_ref(x, gate, up, bias, up_bias), rtol=1e-5, atol=1e-5)


def test_strided_inputs_and_weights_are_read_as_their_values():
    x, weight = torch.randn(5, 48)[:, ::2], torch.randn(24, 7).T  # neither contiguous
    torch.testing.assert_close(linear_rows_cpu(x, weight), linear_rows_ref(x, weight), rtol=1e-5, atol=1e-5)


def test_bad_arguments_are_refused_by_name():
    x, weight = torch.randn(3, 8), torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="float32 only"):
        linear_rows_cpu(x.double(), weight.double())
    with pytest.raises(RuntimeError, match=r"weight \[out, in\]"):
        linear_rows_cpu(x, torch.randn(4, 9))
    with pytest.raises(RuntimeError, match="bias must be float32"):
        linear_rows_cpu(x, weight, torch.randn(5))
    with pytest.raises(RuntimeError, match="residual must be float32"):
        linear_rows_cpu(x, weight, None, torch.randn(3, 5))
    with pytest.raises(RuntimeError, match="gate and up weights of one shape"):
        gated_rows_cpu(x, weight, torch.randn(5, 8))
