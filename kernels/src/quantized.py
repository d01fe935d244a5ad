"""Quantized history for the paged kernels: what a layer hands them, and how a format becomes constexprs.

A row of keys (and of values) is a prefix of ``lens[row]`` *quantized* tokens -- whole blocks of a second
pool, listed in ``QuantizedKV.block_tables`` -- followed by the full-precision tokens of the ordinary paged
blocks. Stored index ``s < lens[row]`` is token ``s % block_size`` of quantized block
``block_tables[row, s // block_size]``; ``s >= lens[row]`` is token ``(s - lens[row]) % block_size`` of the
full-precision block ``fp_block_tables[row, (s - lens[row]) // block_size]``. ``seq_lens`` counts both parts,
and causal masks and sliding windows use ``s`` exactly as without quantization.

The storage formats are those of ``hf_paged_cache.quantization`` (codes, float16 scales and zero points per
block, ``[num_qblocks, *fmt.fields(...)]`` per field). Each format declares how the kernels see it, its
``KernelFormat`` (``fmt.kernel_format``); its fields become constexprs of the kernels (``BITS``,
``EXPONENT_BITS``, ``ZERO_POINT``, ``QMAX``, ``PER_TOKEN``, ``GROUP``, ``SCALE_BITS``, ``ROTATE``: see ``format_constexprs``) prefixed
``K_`` / ``V_``, so key and value formats make compile-time variants independently (``K4V2`` is one kernel
variant, not a runtime branch). Nothing here or in the kernels names a format class.

Adding a format: a class in a module of ``hf_paged_cache.quantization`` (one ``register_format`` line names it)
whose ``kernel_format`` describes its codes with an encoding of ``KernelFormat`` (integer codes of 2, 4 or 8 bits
with or without a zero point, float8 codes) needs no kernel change. A new encoding (say, codes looked up in a table) is a new ``KernelFormat`` field and
one branch on it in each of the two JIT functions that know encodings, ``dequantize.decode_codes`` (codes
to numbers) and ``seal.encode_codes`` (numbers to codes), plus its case in ``_check_encoding`` here (and, if
its scales are not absmax- or min/max-based, in ``seal.quantize_tile``'s metadata step).

This module is plain Python and torch (no triton import): cache layers can build a ``QuantizedKV`` without
triggering kernel compilation or fixing ``TRITON_INTERPRET``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from hf_paged_cache.quantization import KernelFormat, QuantFormat

# The smallest head a kernel tile holds unpadded (launch.MIN_DOT): rotated heads must fill their tile.
_MIN_ROTATED_HEAD_DIM = 16

# The constexpr of each KernelFormat field: its name upper-cased.
CONSTEXPR_NAMES = tuple(field.name.upper() for field in dataclasses.fields(KernelFormat))


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


def _check_encoding(fmt: QuantFormat, kernel_format: KernelFormat, block_size: int, head_dim: int) -> None:
    """``kernel_format`` must be an encoding the JIT code implements (see ``KernelFormat``), codes stored
    in the dtype it reads them as."""
    spec = fmt.fields(block_size, 1, head_dim)
    codes_dtype, scale_dtype = spec["codes"][1], spec["scale"][1]
    bits, exponent_bits, zero_point = kernel_format.bits, kernel_format.exponent_bits, kernel_format.zero_point
    if exponent_bits:  # float8 bit patterns
        supported = bits == 8 and exponent_bits <= 5 and not zero_point and codes_dtype == torch.uint8
    elif zero_point:  # unsigned integers, packed planar below 8 bits
        supported = bits in (2, 4, 8) and codes_dtype == torch.uint8
    else:  # signed whole bytes
        supported = bits == 8 and codes_dtype == torch.int8
    if kernel_format.scale_bits == 8:  # uint8 steps of a unit stored after the zero points, per block
        supported &= zero_point and not kernel_format.per_token and scale_dtype == torch.uint8
    else:
        supported &= kernel_format.scale_bits == 16 and scale_dtype == torch.float16
    if not supported or kernel_format.qmax <= 0:
        raise ValueError(
            f"no kernel variant for {fmt!r}: {kernel_format} with {codes_dtype} codes and {scale_dtype} scales is "
            "not an encoding the kernels implement (uint8 float8 bit patterns; unsigned 2, 4 or 8-bit integers in "
            "uint8 with a zero point; int8 integers without; float16 scales, or uint8 ones per block with a zero "
            "point)"
        )


def format_constexprs(fmt: QuantFormat, block_size: int, head_dim: int) -> dict:
    """The constexprs a kernel needs to read or write ``fmt`` blocks of this block size and head dim: the
    fields of the format's own ``fmt.kernel_format(block_size, head_dim)``, named upper-case.

    Every kernel that handles a side takes all of them (``QMAX`` only matters when writing codes). Checked
    here for every format alike: kernels reshape a head into ``[groups, GROUP]`` to reduce or expand
    per-group metadata, which needs a power-of-two ``GROUP`` unless a single group spans the head, and
    tile whole blocks, which needs a power-of-two ``block_size``; the codes must be an encoding the kernels
    implement; a rotated format needs a head that fills a tile exactly (a power of two, at least 16).
    Otherwise a ValueError names the format.
    """
    if not _is_power_of_two(block_size):
        raise ValueError(f"no kernel variant for {fmt!r} at block_size {block_size}: it must be a power of two")
    kernel_format = fmt.kernel_format(block_size, head_dim)
    if kernel_format.group < head_dim and not _is_power_of_two(kernel_format.group):
        raise ValueError(
            f"no kernel variant for {fmt!r} at head_dim {head_dim}, block_size {block_size}: its scale groups "
            f"of {kernel_format.group} channels must be a power of two (or span the whole head)"
        )
    if kernel_format.rotate and not (_is_power_of_two(head_dim) and head_dim >= _MIN_ROTATED_HEAD_DIM):
        raise ValueError(
            f"no kernel variant for {fmt!r} at head_dim {head_dim}: a rotated format needs a power-of-two head_dim "
            f"of at least {_MIN_ROTATED_HEAD_DIM} (the kernels rotate whole, unpadded tiles)"
        )
    _check_encoding(fmt, kernel_format, block_size, head_dim)
    return dict(zip(CONSTEXPR_NAMES, dataclasses.astuple(kernel_format)))


def side_args(
    side: str, fmt: QuantFormat | None, fields: dict[str, torch.Tensor] | None, block_size: int, head_dim: int
) -> tuple[dict, dict]:
    """(runtime arguments, constexprs) of one side, ``side`` "k" or "v": its pool's code / scale / zero
    pointers and their (block, token, head) strides, and ``format_constexprs`` prefixed ``K_`` / ``V_``.

    Per-block metadata has no token dim: its token stride is 0. Without a format everything is None (the
    JIT turns None into a constexpr, and the kernels never touch these arguments).
    """
    names = [f"{side}_{name}" for name in ("codes", "scales", "zeros")]
    names += [f"stride_{side}{part}_{dim}" for part in ("code", "meta") for dim in ("block", "tok", "head")]
    prefix = f"{side.upper()}_"
    if fmt is None:
        return dict.fromkeys(names), {prefix + name: None for name in CONSTEXPR_NAMES}
    constexprs = format_constexprs(fmt, block_size, head_dim)
    codes, scales = fields["codes"], fields["scale"]  # scales: [n, block, heads(, groups)] or [n, heads(, groups)]
    if constexprs["PER_TOKEN"]:
        meta_strides = (scales.stride(0), scales.stride(1), scales.stride(2))
    else:
        meta_strides = (scales.stride(0), 0, scales.stride(1))
    values = [codes, scales, fields.get("zero"), codes.stride(0), codes.stride(1), codes.stride(2), *meta_strides]
    return dict(zip(names, values)), {prefix + name: value for name, value in constexprs.items()}


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
    k_args, k_constexprs = side_args("k", *key, block_size, head_dim)
    v_args, v_constexprs = side_args("v", *value, block_size, head_dim)
    constexprs = dict(QUANTIZED=quantized is not None, **k_constexprs, **v_constexprs)
    args = dict(**k_args, **v_args, quant_tables=None, quant_lens=None, stride_quant_table=None)
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
