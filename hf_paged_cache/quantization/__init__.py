"""Quantized KV-block formats (int8, KIVI int4 / int2, fp8), named by spec strings through the registry; importing
the package registers its formats."""

from .base import KernelFormat, KVFormat, QuantFormat
from .fp8 import FP8
from .int_n import Int8, IntN
from .packing import pack_codes, unpack_codes
from .registry import format_from_fields, format_from_spec, register_format
from .rotation import hadamard, rotate_heads

__all__ = [
    "FP8",
    "Int8",
    "IntN",
    "KVFormat",
    "KernelFormat",
    "QuantFormat",
    "format_from_fields",
    "format_from_spec",
    "hadamard",
    "pack_codes",
    "register_format",
    "rotate_heads",
    "unpack_codes",
]
