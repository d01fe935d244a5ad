"""Quantized history for the paged kernels: what a layer hands them, and how a format becomes constexprs.

A row of keys (and of values) is a prefix of ``lens[row]`` *quantized* tokens -- whole blocks of a second
pool, listed in ``QuantizedKV.block_tables`` -- followed by the full-precision tokens of the ordinary paged
blocks. Stored index ``s < lens[row]`` is token ``s % block_size`` of quantized block
``block_tables[row, s // block_size]``; ``s >= lens[row]`` is token ``(s - lens[row]) % block_size`` of the
full-precision block ``fp_block_tables[row, (s - lens[row]) // block_size]``. ``seq_lens`` counts both parts,
and causal masks and sliding windows use ``s`` exactly as without quantization.

The storage formats are those of ``hf_paged_cache.quantization`` (codes, float16 scales and zero points per
block, ``[num_qblocks, *fmt.fields(...)]`` per field). Each becomes four constexprs of the kernels -- ``KIND``,
``BITS``, ``PER_TOKEN``, ``GROUP`` (see ``format_constexprs``) -- prefixed ``K_`` / ``V_``, so key and value
formats make compile-time variants independently (``K4V2`` is one kernel variant, not a runtime branch).

This module is plain Python and torch (no triton import): cache layers can build a ``QuantizedKV`` without
triggering kernel compilation or fixing ``TRITON_INTERPRET``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_paged_cache.quantization import FP8, Int8, IntN, QuantFormat

# The constexpr KIND of each family of formats.
KIND_INT8 = "int8"  # symmetric signed int8 codes, x = scale * code
KIND_UINT = "uint"  # asymmetric unsigned 2 / 4-bit codes packed planar, x = zero + scale * code
KIND_FP8 = {"e4m3": "e4m3", "e5m2": "e5m2"}  # float8 bit patterns stored as uint8, x = scale * fp8(code)


@dataclass(frozen=True)
class QuantizedKV:
    """The quantized prefix of every row of one layer, as the kernels read (and the seal kernel writes) it.

    ``key_fields`` / ``value_fields``: the pools of ``key_format`` / ``value_format`` -- ``{name: [num_qblocks,
    *shape]}`` as ``fmt.allocate`` makes them (each field's last dim contiguous). ``block_tables``: int32
    ``[batch, max_qblocks]`` quantized block ids per row; ``lens``: int32 ``[batch]`` quantized tokens per row,
    a multiple of the block size (quantized blocks are always full).
    """

    key_format: QuantFormat
    value_format: QuantFormat
    key_fields: dict[str, torch.Tensor]
    value_fields: dict[str, torch.Tensor]
    block_tables: torch.Tensor
    lens: torch.Tensor


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _meta_per_token(fmt: QuantFormat) -> bool:
    """Whether ``fmt`` stores a scale per token (Int8, IntN "token", FP8 "token") rather than per block."""
    if isinstance(fmt, IntN):
        return fmt.axis == "token"
    if isinstance(fmt, FP8):
        return fmt.granularity == "token"
    return True


def format_constexprs(fmt: QuantFormat, block_size: int, head_dim: int) -> dict:
    """The constexprs a kernel needs to read or write ``fmt`` blocks of this block size and head dim.

    - ``KIND``: ``"int8"``, ``"uint"`` (IntN) or ``"e4m3"`` / ``"e5m2"`` (FP8);
    - ``BITS``: bits per code (8, 4 or 2); codes of 4 / 2 bits are packed planar (``pack_codes``);
    - ``PER_TOKEN``: one scale (and zero) per token (True) or per block (IntN "channel", FP8 "head");
    - ``GROUP``: channels sharing a scale (``head_dim`` when a whole head does).

    Kernels reshape a head into ``[groups, GROUP]`` to reduce or expand per-group metadata, which needs a
    power-of-two ``GROUP`` unless a single group spans the head, and tile whole blocks, which needs a
    power-of-two ``block_size``: other combinations raise a ValueError naming the format.
    """
    if not _is_power_of_two(block_size):
        raise ValueError(f"no kernel variant for {fmt!r} at block_size {block_size}: it must be a power of two")
    if isinstance(fmt, Int8):
        return dict(KIND=KIND_INT8, BITS=8, PER_TOKEN=True, GROUP=head_dim)
    if isinstance(fmt, FP8):
        return dict(KIND=KIND_FP8[fmt.fmt], BITS=8, PER_TOKEN=_meta_per_token(fmt), GROUP=head_dim)
    if isinstance(fmt, IntN):
        group = fmt.group(head_dim, block_size)
        if group < head_dim and not _is_power_of_two(group):
            raise ValueError(
                f"no kernel variant for {fmt!r} at head_dim {head_dim}, block_size {block_size}: its scale groups "
                f"of {group} channels must be a power of two (or span the whole head)"
            )
        return dict(KIND=KIND_UINT, BITS=fmt.bits, PER_TOKEN=_meta_per_token(fmt), GROUP=group)
    raise ValueError(f"no kernel variant for the quantization format {fmt!r}")


def side_constexprs(prefix: str, fmt: QuantFormat | None, block_size: int, head_dim: int) -> dict:
    """``format_constexprs`` with every name prefixed (``K_`` / ``V_``); all None without a format."""
    if fmt is None:
        return {f"{prefix}{name}": None for name in ("KIND", "BITS", "PER_TOKEN", "GROUP")}
    return {f"{prefix}{name}": value for name, value in format_constexprs(fmt, block_size, head_dim).items()}


def check_fields(
    fmt: QuantFormat, fields: dict[str, torch.Tensor], block_size: int, kv_heads: int, head_dim: int, what: str
) -> None:
    """``fields`` must be a pool of ``fmt`` blocks for this shape, with a contiguous last dim per field."""
    for name, (shape, dtype) in fmt.fields(block_size, kv_heads, head_dim).items():
        tensor = fields.get(name)
        if tensor is None or tuple(tensor.shape[1:]) != shape or tensor.dtype != dtype or tensor.stride(-1) != 1:
            got = None if tensor is None else (tuple(tensor.shape), tensor.dtype, tensor.stride())
            raise ValueError(
                f"{what} field {name!r} must be [num_qblocks, *{shape}] of {dtype} with a contiguous last dim "
                f"for {fmt!r} (block_size {block_size}, {kv_heads} KV heads, head_dim {head_dim}); got {got}"
            )


def field_args(prefix: str, fmt: QuantFormat | None, fields: dict[str, torch.Tensor] | None) -> dict:
    """Kernel arguments of one side's pool: code / scale / zero pointers and their (block, token, head) strides.

    Per-block metadata has no token dim: its token stride is 0. Without a format everything is None (the
    JIT turns None into a constexpr, and the kernels never touch these arguments).
    """
    names = [f"{prefix}_{name}" for name in ("codes", "scales", "zeros")]
    names += [f"stride_{prefix}{part}_{dim}" for part in ("code", "meta") for dim in ("block", "tok", "head")]
    if fmt is None:
        return dict.fromkeys(names)
    codes, scales = fields["codes"], fields["scale"]  # scales: [n, block, heads(, groups)] or [n, heads(, groups)]
    if _meta_per_token(fmt):
        meta_strides = (scales.stride(0), scales.stride(1), scales.stride(2))
    else:
        meta_strides = (scales.stride(0), 0, scales.stride(1))
    values = [codes, scales, fields.get("zero"), codes.stride(0), codes.stride(1), codes.stride(2), *meta_strides]
    return dict(zip(names, values))


def attention_args(
    quantized: QuantizedKV | None, batch: int, block_size: int, kv_heads: int, head_dim: int, device: torch.device
) -> tuple[dict, dict]:
    """(runtime arguments, constexprs) that the paged attention kernels take for the quantized prefix.

    Validates ``quantized`` against the launch's shape. ``None`` gives the unquantized variant: every
    argument None and ``QUANTIZED=False``, which compiles to exactly the kernel without the quantized path.
    """
    if quantized is None:
        key = value = (None, None)
    else:
        key, value = (quantized.key_format, quantized.key_fields), (quantized.value_format, quantized.value_fields)
    constexprs = dict(
        QUANTIZED=quantized is not None,
        **side_constexprs("K_", key[0], block_size, head_dim),
        **side_constexprs("V_", value[0], block_size, head_dim),
    )
    args = dict(
        **field_args("k", *key), **field_args("v", *value), quant_tables=None, quant_lens=None, stride_quant_table=None
    )
    if quantized is None:
        return args, constexprs
    check_fields(quantized.key_format, quantized.key_fields, block_size, kv_heads, head_dim, "key")
    check_fields(quantized.value_format, quantized.value_fields, block_size, kv_heads, head_dim, "value")
    tables, lens = quantized.block_tables, quantized.lens
    if tables.dim() != 2 or tables.shape[0] != batch or tables.dtype != torch.int32 or lens.shape != (batch,) or (
        lens.dtype != torch.int32
    ):
        raise ValueError(
            f"quantized block_tables must be int32 [batch={batch}, max_qblocks] and lens int32 [{batch}], got "
            f"{tuple(tables.shape)} {tables.dtype} and {tuple(lens.shape)} {lens.dtype}"
        )
    tensors = [tables, lens, *quantized.key_fields.values(), *quantized.value_fields.values()]
    if any(t.device != device for t in tensors):
        raise ValueError(f"the quantized tables and fields must be on {device}, like the query")
    args.update(quant_tables=tables, quant_lens=lens, stride_quant_table=tables.stride(0))
    return args, constexprs
