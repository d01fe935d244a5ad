"""`SealedBlocks`: a quantized layer's sealed blocks, stored and coded in the group's `KVFormat`.

The store holds each side's format fields (codes, scales, zero points), `[sealed blocks + 1, ...]` each; the codec
seals full-precision blocks into them (one vectorized `quantize` per side, or one Triton launch, or the C++
encode) and decodes them back. Which blocks are sealed when is the tables' business (`blocks.sealing`).
"""

from __future__ import annotations

import functools

import torch

from ..blocks.pool import BlockPool
from ..kernels import cpu_quantize
from ..quantization.base import KVFormat
from .storage import BlockStore, reserved_blocks

SIDES = ("qkey", "qvalue")  # the saved names' prefixes, keys then values


class SealedBlocks(BlockStore):
    """Sealed keys and values in `kv_format`: stored as its fields, flat by saved name (`qkey.codes`, ...)."""

    def __init__(self, kv_format: KVFormat):
        super().__init__()
        self.kv_format = kv_format
        self._formats = (kv_format.key, kv_format.value)
        self._split: tuple[dict | None, dict] = (None, {})  # (the tensors `fields` split, by side)

    def allocate(self, pool: BlockPool, block_size: int, kv_heads: int, dims: tuple[int, int],
                 device: torch.device) -> None:  # fmt: skip
        """Allocate for `pool`'s blocks of `block_size` tokens, `kv_heads` heads of widths `dims` (key, value)."""
        self.block_size, self.kv_heads, self.dims = block_size, kv_heads, dims
        self._allocate(pool, functools.partial(self._tensors, device))

    def _tensors(self, device: torch.device, blocks: int, zeroed: bool, growable: bool) -> dict[str, torch.Tensor]:
        bs, heads = self.block_size, self.kv_heads
        room = reserved_blocks(blocks, self.kv_format.key.bytes_per_block(bs, heads, self.dims[0]), device, growable)
        tensors = {}
        for side, fmt, dim in zip(SIDES, self._formats, self.dims):
            fields = fmt.allocate(blocks, bs, heads, dim, device, zeroed, room)
            tensors.update({f"{side}.{name}": tensor for name, tensor in fields.items()})
        return tensors

    def fields(self, side: str) -> dict[str, torch.Tensor]:
        """One side's format fields (`"qkey"` or `"qvalue"`), by field name (split once per set of tensors: every
        read asks)."""
        if self._split[0] is not self.tensors:
            split: dict[str, dict[str, torch.Tensor]] = {prefix: {} for prefix in SIDES}
            for name, tensor in self.tensors.items():
                prefix, field = name.split(".", 1)
                split[prefix][field] = tensor
            self._split = (self.tensors, split)
        return self._split[1][side]

    @torch.no_grad()
    def seal(self, key_blocks: torch.Tensor, value_blocks: torch.Tensor, src: torch.Tensor, targets: list[int],
             kernels: bool, cpu: bool) -> dict[str, list[float]]:  # fmt: skip
        """Blocks `src` of `key_blocks` / `value_blocks` (a layer's storage, or a transient copy) into sealed blocks
        `targets`: in one Triton launch (`kernels`), by the C++ encode (`cpu`, bit for bit the format's), or by the
        format's torch code. Returns per side the relative errors of a decoded sample (the first block): per token
        and head, relative to the head's mean token norm in the block (a near-zero token would make its own norm a
        meaningless denominator)."""
        dst = torch.tensor(targets, device=self.device)
        sides = [(side, blocks, fmt, self.fields(side))
                 for side, blocks, fmt in zip(SIDES, (key_blocks, value_blocks), self._formats)]  # fmt: skip
        if kernels:
            from ..kernels import quantize_blocks

            quantize_blocks(key_blocks, value_blocks, src, sides[0][3], sides[1][3], dst, *self._formats)
        errors = {}
        for side, blocks, fmt, fields in sides:
            if cpu:
                error = cpu_quantize.quantize_blocks_cpu(fmt, blocks, src, fields, dst)
            else:
                if not kernels:
                    fmt.quantize(blocks.index_select(0, src), fields, dst)
                sample = blocks[src[:1]].float()
                decoded = fmt.dequantize(fields, dst[:1])
                scale = sample.norm(dim=-1).mean(dim=1, keepdim=True).clamp(min=1e-12)
                error = (decoded - sample).norm(dim=-1) / scale
            errors[side] = error.flatten().tolist()  # a few dozen numbers: reduced by the caller, not a tensor op each
        return errors

    def decoded(self, blocks: slice | list[int], dtype: torch.dtype,
                rotated: bool = False) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """Blocks decoded as `[kv_heads, tokens, d]` keys and values (a rotated side as stored, if `rotated`: see
        `QuantFormat.dequantize`)."""
        keys, values = (fmt.dequantize(self.fields(side), blocks, dtype, rotated)
                        for side, fmt in zip(SIDES, self._formats))  # fmt: skip
        return keys.flatten(0, 1).transpose(0, 1), values.flatten(0, 1).transpose(0, 1)

    def decoded_keys(self, blocks: slice | list[int]) -> torch.Tensor:
        """Blocks' keys decoded as `[kv_heads, tokens, d]` (eviction scores)."""
        return self.kv_format.key.dequantize(self.fields("qkey"), blocks).flatten(0, 1).transpose(0, 1)

    def decoded_buffer(self, blocks: slice, tokens: int, extra: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Blocks decoded (rotated sides as stored) into float32 `[kv_heads, tokens + extra, d]` K and V buffers,
        whose last `extra` columns are left for the caller."""
        out = []
        for side, fmt, dim in zip(SIDES, self._formats, self.dims):
            buffer = torch.empty(self.kv_heads, tokens + extra, dim, device=self.device)
            target = buffer[:, :tokens].unflatten(1, (tokens // self.block_size, self.block_size)).permute(1, 2, 0, 3)
            fmt.dequantize(self.fields(side), blocks, torch.float32, rotated=True, out=target)
            out.append(buffer)
        return out[0], out[1]

    def round_trip(self, key_blocks: torch.Tensor, value_blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Full-precision blocks `[n, block_size, kv_heads, d]` as they will read once sealed: coded into scratch
        fields and decoded (float32, rotated sides as stored), `[kv_heads, tokens, d]` each."""
        count, out = len(key_blocks), []
        for fmt, blocks, dim in zip(self._formats, (key_blocks, value_blocks), self.dims):
            scratch = fmt.allocate(count, self.block_size, self.kv_heads, dim, device=self.device)
            fmt.quantize(blocks, scratch, range(count))
            decoded = fmt.dequantize(scratch, slice(0, count), torch.float32, rotated=True)
            out.append(decoded.flatten(0, 1).transpose(0, 1))
        return out[0], out[1]
