"""The interface of a quantized storage format for KV-cache blocks: codes + scales (+ zero points), block by block.

Why keys and values get different formats (KIVI, Liu et al. 2024): keys have a few outlier channels that are large
for every token, so they are quantized per channel over a block's tokens; values have no such structure and the
attention output is a per-token weighted sum of them, so they are quantized per token. A per-channel group needs
all of its tokens, so a key block is quantized once full and the last block stays in full precision until then
(keeping that residual window is the storage layer's job). Quantization happens exactly once per token (per-token
formats) or per full block (per-block formats); history is never re-quantized.

Storage. A format describes ONE block as named fields, `fields(block_size, kv_heads, head_dim) -> {name: (shape,
dtype)}`; a pool of `num_blocks` blocks holds, per field, a tensor `[num_blocks, *shape]` (`allocate`). All-zero
fields dequantize to exact zeros, so a zero-filled null block stays zero. Field names are "codes", "scale" and,
for asymmetric formats, "zero". Writes (`quantize`) and reads (`dequantize`) are one vectorized call per pool.
`kernel_format` tells the Triton kernels how the codes are encoded, so they read and write a format without
naming it. A format is named by the registry (`registry.register_format`), which also parses spec strings.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Union

import torch
from torch import Tensor

from .rotation import rotate_heads

__all__ = ["BlockIds", "FieldSpec", "KVFormat", "KernelFormat", "QuantFormat", "as_ids", "head_major_float"]

FieldSpec = dict[str, tuple[tuple[int, ...], torch.dtype]]
BlockIds = Union[Tensor, Sequence[int]]


def as_ids(ids: BlockIds, device: torch.device) -> Tensor:
    """Block ids (a tensor or a sequence of ints) as a flat long tensor on `device`."""
    return torch.as_tensor(ids, dtype=torch.long, device=device).reshape(-1)


def head_major_float(codes: Tensor, head_dim: int, out: Tensor | None = None) -> Tensor:
    """An uninitialised float32 `[..., block, heads, head_dim]` (the codes' leading dims) laid out head-major in
    memory (a permuted view of `[heads, ..., block, head_dim]`), so that each head's decoded tokens are contiguous
    for the attention matmuls that read them; `out` (a caller's buffer of that shape) if given."""
    if out is not None:
        return out
    *leading, block, heads = codes.shape[:-1]
    buffer = torch.empty((heads, *leading, block, head_dim), dtype=torch.float32, device=codes.device)
    return buffer.permute(*range(1, len(leading) + 2), 0, len(leading) + 2)


@dataclass(frozen=True)
class KernelFormat:
    """A format's blocks as the Triton kernels (`hf_paged_cache.kernels`) read and write them.

    The kernels know *encodings*, not format classes: they compile one variant per `KernelFormat` and
    branch only on these fields, so a new format whose codes use an encoding below runs in them as it
    is -- its class returns its `KernelFormat` from `kernel_format`, and no kernel code changes.

    - Integer codes with a `zero_point`: x = zero + scale * code, unsigned codes in [0, qmax] (a "zero"
      field holds the zero points), `bits` 8 (uint8) or 2 / 4, packed planar into uint8 (`pack_codes`).
    - Integer codes without (`exponent_bits` 0): x = scale * code, int8 codes in [-qmax, qmax].
    - float8 codes (`exponent_bits` e > 0, 7 - e mantissa bits, exponent bias 2**(e - 1) - 1, as in
      e4m3fn / e5m2): their uint8 bit patterns, x = scale * code; `qmax` is the largest finite value.

    Metadata is float16: one scale (and zero point) per `group` adjacent channels of a KV head, per
    token (`per_token`) or per block (then shared by all of the block's tokens). `scale_bits` 8 (integer
    codes with a zero point, per block only): scales are uint8 numbers of steps of a float16 unit stored
    after the KV head's zero points (the zero field holds groups + 1 values, see `IntN`).
    `rotate`: the codes encode each token's head vector times the normalized Hadamard matrix
    (`hadamard`; head_dim a power of two), which readers undo (see `IntN.rotate`).
    """

    bits: int
    exponent_bits: int
    zero_point: bool
    qmax: float
    per_token: bool
    group: int
    scale_bits: int = 16
    rotate: bool = False


class QuantFormat:
    """Storage layout + encode / decode of one K or V block. Subclasses (frozen dataclasses, registered by name
    with `registry.register_format`) implement `fields`, `_encode`, `_decode` and `kernel_format`; this class
    does the byte accounting and the vectorized block / token indexing.

    `_encode` maps float32 `[..., block_size, kv_heads, head_dim]` (whole blocks) or, for per-token
    formats, `[..., kv_heads, head_dim]` to the field values with the same leading dims; `_decode`
    maps the fields of blocks (any leading dims) back to float32 `[..., block_size, kv_heads, head_dim]`.
    A class that names cache-wide formats in spec strings overrides `parse_spec` and `SPECS`.
    """

    SPECS: ClassVar[str] = ""  # the spec strings `parse_spec` reads, as listed in the parser's error message
    needs_full_block: bool = False
    rotate: bool = False  # codes encode head vectors times the normalized Hadamard matrix (see `IntN.rotate`)

    @classmethod
    def parse_spec(cls, text: str) -> KVFormat | None:
        """The key and value formats that spec `text` (stripped, lower case) names, None if it is not one of
        this family's."""
        return None

    def fields(self, block_size: int, kv_heads: int, head_dim: int) -> FieldSpec:
        raise NotImplementedError

    def kernel_format(self, block_size: int, head_dim: int) -> KernelFormat:
        """How the Triton kernels read and write this format's blocks of this size (see `KernelFormat`)."""
        raise NotImplementedError

    def code_space(self, x: Tensor) -> Tensor:
        """Head vectors `x` in the space the codes encode, or back (the rotation is its own inverse): float32
        rotated vectors for a rotating format, `x` itself otherwise. A reader that maps its queries and outputs
        this way can attend over decoded blocks as stored (`dequantize(..., rotated=True)`)."""
        return rotate_heads(x.float()) if self.rotate else x

    def bytes_per_block(self, block_size: int, kv_heads: int, head_dim: int) -> int:
        """Exact bytes of one block: the sum over fields of elements x element size."""
        spec = self.fields(block_size, kv_heads, head_dim)
        return sum(math.prod(shape) * dtype.itemsize for shape, dtype in spec.values())

    def bytes_per_token(self, kv_heads: int, head_dim: int, block_size: int) -> float:
        """`bytes_per_block / block_size`: per-block metadata amortized over the block's tokens."""
        return self.bytes_per_block(block_size, kv_heads, head_dim) / block_size

    def ratio_to_fp16(self, kv_heads: int, head_dim: int, block_size: int) -> float:
        """`bytes_per_token` relative to float16 storage (2 bytes per element)."""
        return self.bytes_per_token(kv_heads, head_dim, block_size) / (2 * kv_heads * head_dim)

    def allocate(
        self, num_blocks: int, block_size: int, kv_heads: int, head_dim: int, device=None, zeroed: bool = True,
        capacity: int | None = None,
    ) -> dict[str, Tensor]:
        """Pool tensors `[num_blocks, *shape]` per field: zero-filled (zeros dequantize to zeros), or uninitialised
        when not `zeroed` (for a caller that fills them itself). `capacity` (at least `num_blocks`): the blocks
        each field's allocation has room for, untouched after the first `num_blocks` (`layers/storage.py`)."""
        capacity = max(num_blocks, capacity or 0)
        tensors = {
            name: torch.empty((capacity, *shape), dtype=dtype, device=device)[:num_blocks]
            for name, (shape, dtype) in self.fields(block_size, kv_heads, head_dim).items()
        }
        if zeroed:
            for tensor in tensors.values():
                tensor.zero_()
        return tensors

    @torch.no_grad()
    def quantize(self, x: Tensor, out: dict[str, Tensor], blocks: BlockIds, offsets: BlockIds | None = None) -> None:
        """Write the codes of `x` into the pool tensors `out[name]` (one vectorized index_put per field).

        - `offsets is None`: `x` is `[n, block_size, kv_heads, head_dim]`, whole blocks `blocks[i]`;
        - otherwise (per-token formats only): `x` is `[T, kv_heads, head_dim]`, token t goes to slot
          `offsets[t]` of block `blocks[t]`. Duplicate (block, offset) pairs leave one of them unspecified.
          Per-token formats encode every token independently, so token writes give the codes of a whole write.
        `x` may be float32, float16 or bfloat16; encoding runs in float32.
        """
        device = next(iter(out.values())).device
        blocks = as_ids(blocks, device)
        if offsets is None:
            if x.dim() != 4 or x.shape[0] != blocks.numel():
                raise ValueError(
                    f"whole-block writes take x of shape [len(blocks)={blocks.numel()}, block_size, kv_heads, "
                    f"head_dim], got {tuple(x.shape)}"
                )
            index: tuple[Tensor, ...] = (blocks,)
        else:
            if self.needs_full_block:
                raise ValueError(f"{self!r} quantizes whole blocks only; write full blocks with offsets=None")
            offsets = as_ids(offsets, device)
            if x.dim() != 3 or not x.shape[0] == blocks.numel() == offsets.numel():
                raise ValueError(
                    f"token writes take x [T, kv_heads, head_dim] with T = len(blocks) = len(offsets); got x "
                    f"{tuple(x.shape)}, {blocks.numel()} blocks, {offsets.numel()} offsets"
                )
            index = (blocks, offsets)
        block_size = out["codes"].shape[1]
        if offsets is None and x.shape[1] != block_size:
            raise ValueError(f"x has {x.shape[1]} tokens per block but the pool's blocks hold {block_size}")
        for name, (shape, dtype) in self.fields(block_size, x.shape[-2], x.shape[-1]).items():
            if name not in out or out[name].shape[1:] != shape or out[name].dtype != dtype:
                raise ValueError(
                    f"pool field {name!r} must be [num_blocks, *{shape}] of {dtype} for x {tuple(x.shape)} with "
                    f"{self!r}, got {None if name not in out else (tuple(out[name].shape), out[name].dtype)}"
                )
        for name, value in self._encode(x.float()).items():
            out[name].index_put_(index, value.to(device))

    @torch.no_grad()
    def dequantize(
        self,
        fields: dict[str, Tensor],
        blocks: BlockIds | slice,
        dtype: torch.dtype = torch.float32,
        rotated: bool = False,
        out: Tensor | None = None,
    ) -> Tensor:
        """Blocks `blocks` (ids, a slice of consecutive ids, or a 2-D tensor of ids: a table of rows) of the pool
        `fields`, decoded: `[*ids shape, block_size, kv_heads, head_dim]`. A rotated format's vectors are rotated
        back, unless `rotated` (a reader that rotates its queries and outputs instead takes them as stored).

        `out`: a float32 tensor of that shape (e.g. a view of a reader's larger buffer) to decode into, so a
        reader that attends over decoded blocks and more tokens at once copies nothing; needs float32 and, for a
        rotating format, `rotated`."""
        if isinstance(blocks, slice):  # a slice reads views of the pool; ids gather copies
            parts = {name: tensor[blocks] for name, tensor in fields.items()}
        else:
            device = next(iter(fields.values())).device
            table = isinstance(blocks, Tensor) and blocks.dim() == 2  # a table keeps its shape
            ids = blocks.to(device=device, dtype=torch.long) if table else as_ids(blocks, device)
            parts = {name: tensor.index_select(0, ids.flatten()).view(*ids.shape, *tensor.shape[1:])
                     for name, tensor in fields.items()}  # fmt: skip
        if out is None:
            decoded = self._decode(parts)
            return (decoded if rotated else self.code_space(decoded)).to(dtype)
        if dtype != torch.float32 or (self.rotate and not rotated):
            raise ValueError(f"dequantize(out=...) decodes float32 codes as stored: pass dtype=torch.float32"
                             f"{' and rotated=True' if self.rotate else ''}, got dtype={dtype}, rotated={rotated}")
        decoded = self._decode(parts, out) if _decodes_into(type(self)) else self._decode(parts)
        return decoded if decoded is out else out.copy_(decoded)

    def _encode(self, x: Tensor) -> dict[str, Tensor]:
        raise NotImplementedError

    def _decode(self, fields: dict[str, Tensor], out: Tensor | None = None) -> Tensor:
        """The fields of blocks as float32 `[..., block_size, kv_heads, head_dim]`, written into `out` if given (a
        format may ignore it or leave the parameter out: `dequantize` then copies)."""
        raise NotImplementedError


@functools.lru_cache(maxsize=None)
def _decodes_into(cls: type) -> bool:
    """Whether a format class's `_decode` takes an `out` buffer (a format written before it could does not)."""
    return "out" in inspect.signature(cls._decode).parameters


@dataclass(frozen=True)
class KVFormat:
    """The formats of the key and of the value blocks of one cache (they differ: see the module docstring)."""

    key: QuantFormat
    value: QuantFormat

    @property
    def rotates(self) -> bool:
        """Whether either side's codes encode rotated vectors (a meaning older files could not record)."""
        return self.key.rotate or self.value.rotate

    def bytes_per_block(self, block_size: int, kv_heads: int, head_dim: int, value_dim: int | None = None) -> int:
        """Bytes of one key block plus one value block; `value_dim` is the values' head dim where it differs from
        the keys' (`head_dim`)."""
        return (self.key.bytes_per_block(block_size, kv_heads, head_dim)
                + self.value.bytes_per_block(block_size, kv_heads, value_dim or head_dim))  # fmt: skip

    def bytes_per_token(self, kv_heads: int, head_dim: int, block_size: int) -> float:
        """Bytes of one token's key and value, metadata amortized over the block."""
        return self.bytes_per_block(block_size, kv_heads, head_dim) / block_size

    def ratio_to_fp16(self, kv_heads: int, head_dim: int, block_size: int) -> float:
        """`bytes_per_token` relative to float16 keys + values (4 bytes per element pair)."""
        return self.bytes_per_token(kv_heads, head_dim, block_size) / (4 * kv_heads * head_dim)
