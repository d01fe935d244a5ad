"""rms_norm_cpu / rotary_cpu (the fused layers' element-wise C++ ops) against their references and transformers'."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from hf_paged_cache.kernels import cpu_attention
from hf_paged_cache.kernels.cpu_layer import rms_norm_cpu, rms_norm_ref, rotary_cpu, rotary_ref

pytestmark = pytest.mark.skipif(not cpu_attention.available(),
                                reason="the C++ CPU kernels could not be built here")  # fmt: skip


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 3), st.integers(1, 70), st.sampled_from([8, 24, 40, 576, 37]),
       st.sampled_from([1e-3, 1.0, 50.0]), st.integers(0, 2**16))  # fmt: skip
def test_rms_norm_cpu_is_the_llama_norm_up_to_its_sum_order(batch, tokens, hidden, magnitude, seed):
    """Every hidden size (whole vectors, a remainder, fewer than one vector), any token count (one thread's share
    and several); only the mean's sum runs in another order: a few units in the last place."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, tokens, hidden, generator=generator) * magnitude
    norm = LlamaRMSNorm(hidden, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden, generator=generator))
        expected = norm(x)
    torch.testing.assert_close(rms_norm_ref(x, norm.weight.detach(), 1e-5), expected, rtol=0, atol=0)
    torch.testing.assert_close(rms_norm_cpu(x, norm.weight.detach(), 1e-5), expected, rtol=2e-6, atol=1e-7)


def test_rms_norm_cpu_reads_a_strided_input_and_keeps_zero_rows_finite():
    x = torch.randn(2, 9, 64)[:, ::2]  # not contiguous
    x[0, 0] = 0  # a zero token: eps keeps it finite
    weight = torch.randn(64)
    out = rms_norm_cpu(x, weight, 1e-6)
    assert torch.isfinite(out).all() and (out[0, 0] == 0).all()
    torch.testing.assert_close(out, rms_norm_ref(x, weight, 1e-6), rtol=2e-6, atol=1e-7)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 2), st.integers(1, 40), st.sampled_from([(9, 3), (4, 4), (2, 1)]),
       st.sampled_from([8, 16, 64, 40, 6]), st.integers(0, 2**16))  # fmt: skip
def test_rotary_cpu_gives_the_bits_of_apply_rotary_pos_emb(batch, tokens, heads, dim, seed):
    """Bit for bit transformers' rotation (each product and the sum rounded as its separate ops round them), for head
    dims of whole vectors, halves below one vector and remainders."""
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, tokens, heads[0], dim, generator=generator)
    k = torch.randn(batch, tokens, heads[1], dim, generator=generator)
    angles = torch.rand(batch, tokens, dim // 2, generator=generator) * 100
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    expected = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)  # heads-major, as the model
    got = rotary_cpu(q, k, cos, sin)
    reference = rotary_ref(q, k, cos, sin)
    for ours, ref, hf in zip(got, reference, expected):
        assert ours.is_contiguous() and ours.shape == ref.shape
        assert torch.equal(ours.transpose(1, 2), hf) and torch.equal(ref.transpose(1, 2), hf)


def test_the_ops_refuse_what_they_do_not_compute():
    with pytest.raises(RuntimeError, match="float32 only"):
        rms_norm_cpu(torch.randn(2, 8, dtype=torch.bfloat16), torch.randn(8, dtype=torch.bfloat16), 1e-6)
    with pytest.raises(RuntimeError, match="weight must be"):
        rms_norm_cpu(torch.randn(2, 8), torch.randn(4), 1e-6)
    q, k, cos = torch.randn(1, 3, 2, 8), torch.randn(1, 3, 1, 8), torch.randn(1, 3, 8)
    with pytest.raises(RuntimeError, match="even head dim"):
        rotary_cpu(q[..., :7], k[..., :7], cos[..., :7], cos[..., :7])
    with pytest.raises(RuntimeError, match="agree"):
        rotary_cpu(q, k, cos[:, :2], cos[:, :2])
