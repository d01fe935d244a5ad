"""Helpers for the quantized kernel tests (imported by name: conftest puts this folder on sys.path).

``QuantizedPagedKV`` builds rows of (quantized blocks, full-precision tokens): the full-precision part is a
``PagedKV`` (NaN-filled unused slots), and the quantized prefix is random K/V quantized with the format's
own ``quantize`` into shuffled blocks of the key / value pools, whose spare block has NaN scales and whose
spare table entries point at it -- so a kernel reading a quantized block it should not returns NaN.
"""

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from kernel_testing import DEVICE, PagedKV

from hf_paged_cache.kernels import QuantizedKV
from hf_paged_cache.quantization import KernelFormat, QuantFormat, format_from_spec
from hf_paged_cache.quantization.scales import absmax_scale, nonzero

# The formats of the kernels' format axis (hf_paged_cache.kernels.variants.QUANT_FORMATS).
FORMATS = ("int8", "int4", "int2", "fp8_e4m3", "fp8_e5m2", "K4V2", "K8V4", "K2V2", "K2rV4", "K2rV2r")


@dataclass(frozen=True)
class Int8PerHead(QuantFormat):
    """A format the kernels have never seen: symmetric int8 codes with one float16 scale per KV head per
    block. Its encoding is one they know (whole-byte signed integers, no zero point), so declaring its
    ``kernel_format`` is all it takes to run in them."""

    needs_full_block = True

    def fields(self, block_size, kv_heads, head_dim):
        return {"codes": ((block_size, kv_heads, head_dim), torch.int8), "scale": ((kv_heads,), torch.float16)}

    def kernel_format(self, block_size, head_dim):
        return KernelFormat(bits=8, exponent_bits=0, zero_point=False, qmax=127.0, per_token=False, group=head_dim)

    def _encode(self, x):  # x: [n, block_size, kv_heads, head_dim]
        scale = absmax_scale(x, (1, -1), 127.0)
        codes = torch.round(x / nonzero(scale)).clamp_(-127, 127).to(torch.int8)
        return {"codes": codes, "scale": scale[:, 0, :, 0]}

    def _decode(self, fields):
        return fields["codes"].float() * fields["scale"].float()[:, None, :, None]


class QuantizedPagedKV:
    """``rows``: (quantized blocks, full-precision tokens) per row; ``dense_k[b]`` / ``dense_v[b]`` hold each
    row's K/V as the kernels should see them (the prefix dequantized, float32)."""

    def __init__(self, rows, num_kv_heads, head_dim, block_size, dtype, kv_format, generator):
        self.kv_format = format_from_spec(kv_format) if isinstance(kv_format, str) else kv_format
        self.fp = PagedKV([n for _, n in rows], num_kv_heads, head_dim, block_size, dtype, generator)
        blocks_per_row = [qb for qb, _ in rows]
        num_qblocks = sum(blocks_per_row) + 1
        order = torch.randperm(num_qblocks, generator=generator).tolist()
        spare, used = order[0], iter(order[1:])
        shape = (block_size, num_kv_heads, head_dim)
        self.key_fields = self.kv_format.key.allocate(num_qblocks, *shape)
        self.value_fields = self.kv_format.value.allocate(num_qblocks, *shape)
        for fields in (self.key_fields, self.value_fields):  # NaN metadata (8-bit scales: a NaN unit, in "zero")
            for name, tensor in fields.items():
                if name != "codes" and tensor.is_floating_point():
                    tensor[spare] = float("nan")
        tables = torch.full((len(rows), max(blocks_per_row, default=0) + 1), spare, dtype=torch.int32)
        self.dense_k, self.dense_v = [], []
        for b, (qb, _) in enumerate(rows):
            ids = [next(used) for _ in range(qb)]
            tables[b, :qb] = torch.tensor(ids, dtype=torch.int32)
            prefix = []
            for fmt, fields in ((self.kv_format.key, self.key_fields), (self.kv_format.value, self.value_fields)):
                x = torch.randn(qb, *shape, generator=generator).to(dtype)
                fmt.quantize(x, fields, ids)
                prefix.append(fmt.dequantize(fields, ids).flatten(0, 1))
            self.dense_k.append(torch.cat([prefix[0], self.fp.dense_k[b].float()]))
            self.dense_v.append(torch.cat([prefix[1], self.fp.dense_v[b].float()]))
        lens = torch.tensor([qb * block_size for qb in blocks_per_row], dtype=torch.int32)
        self.seq_lens = (self.fp.seq_lens.cpu() + lens).to(DEVICE)
        self.quantized = QuantizedKV(
            self.kv_format.key, self.kv_format.value,
            {name: t.to(DEVICE) for name, t in self.key_fields.items()},
            {name: t.to(DEVICE) for name, t in self.value_fields.items()},
            tables.to(DEVICE), lens.to(DEVICE),
        )  # fmt: skip

    def cache_args(self):
        """(k_cache, v_cache, block_tables, seq_lens): the full-precision part, and the rows' total lengths."""
        return self.fp.k_cache, self.fp.v_cache, self.fp.block_tables, self.seq_lens


def sdpa_row(q, q_pos, k, v, scale, window=0, softcap=0.0):
    """Dense attention (SDPA, or an explicit softmax with soft-capping) of one row: q [Lq, Hq, D] at stored
    indices q_pos over k/v [Lk, Hkv, D]; float32, rows that see no key give 0."""
    q, k, v = (t.float().cpu().transpose(0, 1) for t in (q, k, v))
    k_pos = torch.arange(k.shape[1])
    mask = k_pos[None, :] <= q_pos.cpu()[:, None]
    if window:
        mask &= k_pos[None, :] > q_pos.cpu()[:, None] - window
    if softcap:
        k, v = (t.repeat_interleave(q.shape[0] // t.shape[0], dim=0) for t in (k, v))
        logits = softcap * torch.tanh(q @ k.transpose(1, 2) * scale / softcap)
        out = torch.softmax(logits.masked_fill(~mask, float("-inf")), dim=-1).nan_to_num() @ v
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True).nan_to_num()
    return out.transpose(0, 1)


# One case per format: (format, cache dtype, head_dim, block_size, group), chosen so that every pair of
# values of the dtype, head dim, block size and group axes meets (checked in test_quantized_prefill.py).
FORMAT_CASES = [
    ("int8", torch.float32, 64, 16, 1),
    ("int4", torch.float16, 128, 16, 1),
    ("int2", torch.bfloat16, 64, 16, 1),
    ("fp8_e4m3", torch.float32, 128, 16, 8),
    ("fp8_e5m2", torch.float16, 64, 32, 8),
    ("K4V2", torch.bfloat16, 128, 32, 8),
    ("K8V4", torch.float32, 64, 32, 1),
    ("K2V2", torch.float16, 128, 32, 1),
    ("K2rV4", torch.float16, 64, 16, 8),  # the rotated query in a 16-bit dot
    ("K2rV2r", torch.float32, 128, 16, 1),
]


def format_params():
    """FORMAT_CASES as pytest parameters with readable ids."""
    ids = [f"{fmt}-{str(dtype)[6:]}-d{head_dim}-bs{bs}-g{group}" for fmt, dtype, head_dim, bs, group in FORMAT_CASES]
    return [pytest.param(*case, id=case_id) for case, case_id in zip(FORMAT_CASES, ids)]
