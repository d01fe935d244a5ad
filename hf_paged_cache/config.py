"""The one validated configuration object of a `PagedCache`.

Every option is checked when the dataclass is built, so a bad value fails at construction with the
parameter's name instead of deep inside `generate()`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

BACKENDS = ("auto", "torch", "triton")

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_bytes(value: int | str, name: str = "max_memory") -> int:
    """Turn `2147483648`, `"2GiB"`, `"512 MB"` or `"1.5GB"` into a positive number of bytes."""
    if isinstance(value, bool):
        raise ValueError(f"`{name}` must be a number of bytes or a string like '2GiB', got {value!r}")
    if isinstance(value, int):
        number, unit = float(value), ""
    elif isinstance(value, str):
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", value)
        if match is None or match.group(2).upper() not in _UNITS:
            raise ValueError(
                f"`{name}`={value!r} is not a size: use an int of bytes or a string like '512MiB', '2GiB', '1.5GB'"
            )
        number, unit = float(match.group(1)), match.group(2).upper()
    else:
        raise ValueError(f"`{name}` must be an int of bytes or a string like '2GiB', got {type(value).__name__}")
    result = int(number * _UNITS[unit])
    if result <= 0:
        raise ValueError(f"`{name}` must be positive, got {value!r}")
    return result


@dataclass(frozen=True)
class PagedCacheConfig:
    """Options of a `PagedCache`.

    Args:
        block_size: tokens per block. Small blocks waste less (at most one partial block per row and
            layer), large blocks make fewer, longer reads. 16 is vLLM's default.
        num_blocks: fixed pool size, in blocks per layer. Mutually exclusive with `max_memory`.
        max_memory: fixed pool size as bytes for all layers together (`int` or a string like "2GiB");
            converted to blocks when the first key/value states arrive and their shape is known.
            With neither `num_blocks` nor `max_memory`, the pool starts small and doubles when it runs
            out, like `DynamicCache` grows; with either, running out raises `OutOfBlocksError`.
        dtype: storage dtype; `None` stores in the dtype of the key/value states the model produces.
        device: storage device; `None` keeps each layer's blocks on the device of its own key/value
            states, so models split over devices with accelerate's `device_map` keep working.
        initial_blocks: blocks a growable pool starts with (ignored for fixed pools).
        backend: who reads and writes blocks under the `"paged"` attention: `"auto"` runs the Triton
            kernels on CUDA tensors and torch elsewhere; `"torch"` always torch; `"triton"` always the
            kernels (on CPU only under `TRITON_INTERPRET=1`, which is how the tests check them).
    """

    block_size: int = 16
    num_blocks: int | None = None
    max_memory: int | str | None = None
    dtype: torch.dtype | None = None
    device: str | torch.device | None = None
    initial_blocks: int = 64
    backend: str = "auto"

    def __post_init__(self) -> None:
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"`block_size` must be a positive int (e.g. 16), got {self.block_size!r}")
        if self.num_blocks is not None and self.max_memory is not None:
            raise ValueError("Give either `num_blocks` or `max_memory` to size the pool, not both")
        if self.num_blocks is not None and (
            isinstance(self.num_blocks, bool) or not isinstance(self.num_blocks, int) or self.num_blocks < 1
        ):
            raise ValueError(f"`num_blocks` must be a positive int, got {self.num_blocks!r}")
        if self.max_memory is not None:
            object.__setattr__(self, "max_memory", parse_bytes(self.max_memory, "max_memory"))
        if self.dtype is not None and (not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point):
            raise ValueError(f"`dtype` must be a floating torch.dtype such as torch.float16, got {self.dtype!r}")
        if self.device is not None:
            try:
                object.__setattr__(self, "device", torch.device(self.device))
            except (RuntimeError, TypeError) as error:
                raise ValueError(f"`device`={self.device!r} is not a torch device: {error}") from None
        if isinstance(self.initial_blocks, bool) or not isinstance(self.initial_blocks, int) or self.initial_blocks < 1:
            raise ValueError(f"`initial_blocks` must be a positive int, got {self.initial_blocks!r}")

        if self.backend not in BACKENDS:
            raise ValueError(f"`backend` must be one of {BACKENDS}, got {self.backend!r}")

    def uses_kernels(self, device: torch.device) -> bool:
        """Whether blocks on `device` are read and written by the Triton kernels."""
        return self.backend == "triton" or (self.backend == "auto" and device.type == "cuda")

    @property
    def growable(self) -> bool:
        """Whether the pool grows on demand (no `num_blocks` / `max_memory` given)."""
        return self.num_blocks is None and self.max_memory is None
