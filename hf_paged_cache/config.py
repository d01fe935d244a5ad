"""The one validated configuration object of a `PagedCache`.

Every option is checked when the dataclass is built, so a bad value fails at construction with the
parameter's name instead of deep inside `generate()`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from .eviction.policies import EvictionPolicy
from .quantization.base import KVFormat
from .quantization.registry import format_from_spec

BACKENDS = ("auto", "torch", "triton")
# The largest `block_size`. A block is the unit of paging: one of 65,536 tokens already holds a whole
# typical context (nothing is left to page), and each row's block alone is 65,536 x bytes per token
# (3 GB for SmolLM2-135M in fp32), so a larger value is a mistake (2**31 used to fail in the allocator).
MAX_BLOCK_SIZE = 2**16

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
            With neither `num_blocks` nor `max_memory`, the pool is sized from the first step and, when it
            runs out, grows to 1.25x the blocks in use (storage included: the pool never holds more than
            1.25x what it uses right after growing); with either, running out raises `OutOfBlocksError`.
        dtype: storage dtype; `None` stores in the dtype of the key/value states the model produces.
        device: storage device; `None` keeps each layer's blocks on the device of its own key/value
            states, so models split over devices with accelerate's `device_map` keep working. A device
            this machine does not have fails here.
        initial_blocks: blocks a growable pool starts with (ignored for fixed pools); `None` sizes it
            from the first step's demand, so the pool never holds much more than it uses.
        backend: who reads and writes blocks under the `"paged"` attention: `"auto"` runs the Triton
            kernels on CUDA tensors and torch elsewhere, where the batch generator's decode tokens and prompt chunks go to
            a C++ kernel compiled at first use (`kernels.cpu_attention`; torch alone if it cannot be built); `"torch"`
            always torch alone; `"triton"` always the kernels (on CPU only under `TRITON_INTERPRET=1`, which is
            how the tests check them).
            Quantized layers run the kernels too (dequantizing in registers). "triton" without CUDA and
            without the interpreter fails here.
        quant: KV quantization of every attention layer: None (full precision) or a format spec of
            `format_from_spec`: "int8", "int4", "int2", "fp8" / "fp8_e4m3", "fp8_e5m2", "K4V2", "K8V4", ...;
            "r" after a side's 2 or 4 bits rotates it (Hadamard): "int2" is "K2V2r".
        quant_layers: `{layer index: spec or None}`, overriding `quant` and `full_precision_layers` for
            those layers.
        full_precision_layers: keep the first N layers in full precision (unless `quant_layers` says otherwise).
        residual_length: the most recent R tokens of a quantized layer stay in full precision; a full
            block is quantized (once, never again) at the first step that starts after it is older than
            that. 0 quantizes every full block at the next step. Quantized pools are sized by `num_blocks`
            like the full-precision ones (one pool of each per quantized group), or grow.
        eviction: a token-eviction policy of `hf_paged_cache.eviction` (e.g. `SnapKV(budget=1024)`), or
            None. Full-attention layers then keep their own block tables (each layer evicts
            independently, so per-layer budgets work); sliding-window layers keep their window and
            evict nothing more. Evicted caches are read by the `"paged"` attention only.
        evict_every: decode steps between evictions; None evicts a row once it holds a block more
            than its budget (so every eviction frees at least one whole block). Rows above their budget
            are also compacted right after a prefill, and whenever the pool would otherwise run out.
        evict_between_chunks: also evict between the chunks of a chunked prefill (keeps peak memory
            near the budget); False evicts only once the prompt is complete.
        share_with: `{layer: source layer}`: the layer reads its source's K/V and stores none (cross-layer
            sharing; the source comes earlier and is an attention layer of the same kind and shapes).
            A model not trained for it changes its outputs: measure the quality first.
        sharing: False turns every sharing feature off, for troubleshooting ("repeated or odd text"):
            identical rows store their blocks separately, beams and forks copy blocks instead of sharing
            them, and `share_with` is ignored (every layer stores its own K/V; a model's own KV-shared layers,
            Gemma-3n's, still read their producer's: the model computes no K/V for them).
    """

    block_size: int = 16
    num_blocks: int | None = None
    max_memory: int | str | None = None
    dtype: torch.dtype | None = None
    device: str | torch.device | None = None
    initial_blocks: int | None = None
    backend: str = "auto"
    quant: str | None = None
    quant_layers: Mapping[int, str | None] | None = None
    full_precision_layers: int = 0
    residual_length: int = 128
    eviction: EvictionPolicy | None = None
    evict_every: int | None = None
    evict_between_chunks: bool = True
    share_with: Mapping[int, int] | None = None
    sharing: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"`block_size` must be a positive int (e.g. 16), got {self.block_size!r}")
        if self.block_size > MAX_BLOCK_SIZE:
            raise ValueError(
                f"`block_size`={self.block_size} is larger than {MAX_BLOCK_SIZE} tokens, longer than any context a "
                "block should page: use a small power of two such as 16 (vLLM's default) or 32"
            )
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
            check_device_exists(self.device)
        if self.initial_blocks is not None and (
            isinstance(self.initial_blocks, bool) or not isinstance(self.initial_blocks, int) or self.initial_blocks < 1
        ):
            raise ValueError(f"`initial_blocks` must be a positive int or None, got {self.initial_blocks!r}")

        if self.backend not in BACKENDS:
            raise ValueError(f"`backend` must be one of {BACKENDS}, got {self.backend!r}")
        self.check_backend(self.device)
        self._validate_quantization()
        if self.eviction is not None and not isinstance(self.eviction, EvictionPolicy):
            raise ValueError(
                f"`eviction` must be a policy from hf_paged_cache.eviction (e.g. SnapKV(budget=1024)), got "
                f"{self.eviction!r}"
            )
        if self.evict_every is not None and (
            isinstance(self.evict_every, bool) or not isinstance(self.evict_every, int) or self.evict_every < 1
        ):
            raise ValueError(f"`evict_every` must be a positive int (decode steps) or None, got {self.evict_every!r}")
        if not isinstance(self.evict_between_chunks, bool):
            raise ValueError(f"`evict_between_chunks` must be a bool, got {self.evict_between_chunks!r}")
        if not isinstance(self.sharing, bool):
            raise ValueError(f"`sharing` must be a bool, got {self.sharing!r}")
        self._validate_share_with()

    def _validate_share_with(self) -> None:
        if self.share_with is None:
            return
        if not isinstance(self.share_with, Mapping):
            raise ValueError(f"`share_with` must map a layer index to an earlier source layer, got {self.share_with!r}")
        # Every pair points backwards before any chain is reported: the remedy for a chain names a layer's
        # source's source, which is only a valid suggestion once every source is known to be earlier.
        for layer, source in self.share_with.items():
            if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in (layer, source)) or source >= layer:
                raise ValueError(
                    f"`share_with` maps layer {layer!r} to {source!r}: give int layer indices with the source earlier "
                    "than the layer that reads it (e.g. {5: 4})"
                )
        for layer, source in self.share_with.items():
            if source in self.share_with:
                raise ValueError(
                    f"`share_with` makes layer {source} both a reader (of layer {self.share_with[source]}) and the "
                    f"source of layer {layer}: point layer {layer} at layer {self.share_with[source]} directly"
                )
        object.__setattr__(self, "share_with", dict(self.share_with))

    def shares_from(self, layer_idx: int) -> int | None:
        """The layer whose K/V `layer_idx` reads (None: it stores its own, also whenever sharing is off)."""
        return (self.share_with or {}).get(layer_idx) if self.sharing else None

    def _validate_quantization(self) -> None:
        formats: dict[str, KVFormat] = {}  # every spec the options name, resolved once (`kv_format`)

        def check_spec(spec, name: str) -> None:
            if spec is None:
                return
            try:
                formats[spec] = format_from_spec(spec)
            except ValueError as error:
                raise ValueError(f"`{name}`: {error}") from None

        check_spec(self.quant, "quant")
        if self.quant_layers is not None:
            if not isinstance(self.quant_layers, Mapping):
                raise ValueError(f"`quant_layers` must map layer indices to format specs, got {self.quant_layers!r}")
            for index, spec in self.quant_layers.items():
                if isinstance(index, bool) or not isinstance(index, int) or index < 0:
                    raise ValueError(f"`quant_layers` keys must be layer indices (ints >= 0), got {index!r}")
                check_spec(spec, f"quant_layers[{index}]")
            object.__setattr__(self, "quant_layers", dict(self.quant_layers))
        for name in ("full_precision_layers", "residual_length"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"`{name}` must be an int >= 0, got {value!r}")
        object.__setattr__(self, "_formats", formats)
        if self.max_memory is not None and self.quantized:
            raise ValueError(
                "`max_memory` cannot be combined with `quant` / `quant_layers` yet (a budget would have to be split "
                "between quantized and full-precision pools): give `num_blocks`, or neither to let the pools grow"
            )

    @property
    def quantized(self) -> bool:
        """Whether any layer may be quantized."""
        return self.quant is not None or any(spec is not None for spec in (self.quant_layers or {}).values())

    def layer_quant(self, layer_idx: int) -> str | None:
        """The format spec of layer `layer_idx` (None: full precision)."""
        if self.quant_layers is not None and layer_idx in self.quant_layers:
            return self.quant_layers[layer_idx]
        return None if layer_idx < self.full_precision_layers else self.quant

    def layer_format(self, layer_idx: int) -> KVFormat | None:
        spec = self.layer_quant(layer_idx)
        return None if spec is None else self.kv_format(spec)

    def kv_format(self, spec: str) -> KVFormat:
        """The format a spec of these options names, resolved once when the options were checked."""
        return self._formats[spec]

    def uses_kernels(self, device: torch.device) -> bool:
        """Whether blocks on `device` are read and written by the Triton kernels."""
        return self.backend == "triton" or (self.backend == "auto" and device.type == "cuda")

    def uses_cpu_kernel(self, device: torch.device) -> bool:
        """Whether packed queries over blocks on `device` may be read by the C++ CPU kernel (where it builds)."""
        return self.backend == "auto" and device.type == "cpu"

    def check_backend(self, device: torch.device | None) -> None:
        """Raise if `backend="triton"` cannot run on `device` (None: wherever the K/V will be): off CUDA,
        Triton runs only under its interpreter (`TRITON_INTERPRET=1`)."""
        if self.backend != "triton":
            return
        on_cuda = device.type == "cuda" if device is not None else torch.cuda.is_available()
        if on_cuda:
            return
        import triton

        if not triton.knobs.runtime.interpret:
            where = f"on {device}" if device is not None else "without CUDA"
            raise ValueError(
                f"`backend`='triton' {where} needs Triton's CPU interpreter: set the environment variable "
                "TRITON_INTERPRET=1 before the first forward (as the tests do), or use backend='auto' "
                "(kernels on CUDA, torch elsewhere) or 'torch'"
            )

    @property
    def growable(self) -> bool:
        """Whether the pool grows on demand (no `num_blocks` / `max_memory` given)."""
        return self.num_blocks is None and self.max_memory is None


def check_device_exists(device: torch.device) -> None:
    """Raise if this machine has no `device` (e.g. "cuda:7" with one GPU, or any "cuda" without CUDA)."""
    if device.type == "cpu":
        return
    accelerator = torch.accelerator.current_accelerator()
    count = torch.accelerator.device_count() if accelerator is not None and accelerator.type == device.type else 0
    if (device.index or 0) >= count:
        raise ValueError(
            f"`device`={str(device)!r} does not exist on this machine ({count} {device.type} device(s)): give an "
            "existing device, or None to keep each layer's blocks on the device of its own K/V"
        )
