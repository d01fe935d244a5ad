"""A C++ paged attention for the CPU torch path: each row's causal queries (a decode token, a prompt chunk) over that
row's blocks, read through its block table.

CPU attention otherwise needs each row's K/V contiguous: a row whose blocks are cut into several runs is copied every
step, every row is one SDPA call, and torch's CPU flash kernel runs a prompt chunk well below the matrix products'
rate. `paged_attention_cpu` reads every row's blocks where they lie, all rows of a layer in one call (query tiles x KV
heads spread over torch's threads; each tile scores all heads of a KV head's group against a chunk of keys at once). It
is built on first use with torch's C++ extension loader for the instruction set torch reports (a C++ compiler and
ninja; `available()` says whether that worked) — without them the torch path runs as before. Float32 only, no soft-cap
and no sinks; `paged_attention_cpu_ref` is its torch reference.

A quantized cache's rows read their sealed blocks first (`QuantizedRows`: decoded in the kernel a chunk of keys at a
time, for the formats `reads_format` accepts), then the blocks a multi-token step reads both ways (`TransitionRows`),
then their full-precision blocks.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from hf_paged_cache.quantization import KernelFormat, QuantFormat

from .reference import gather_kv

# The attention kernel, the fused layers' element-wise ops (`cpu_layer.py`), the products of few rows (`cpu_linear.py`)
# and the write of a step's K/V (`cpu_write.py`): one extension, built together.
SOURCES = [Path(__file__).with_name(name) for name in ("paged_attention_cpu.cpp", "cpu_layer_ops.cpp",
                                                       "cpu_linear_ops.cpp", "cpu_write_ops.cpp")]  # fmt: skip

# The instruction set torch's own CPU kernels use here, and the flags at::vec needs for it (its AVX2 header converts
# float16 with F16C instructions, which every AVX2 processor has).
_CAPABILITY_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX512",
               "-DCPU_CAPABILITY_AVX512"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"],
}  # fmt: skip


def available() -> bool:
    """Whether the C++ kernel is built and loaded (built once per machine and instruction set into torch's extension
    cache)."""
    return _build()


def loaded() -> bool:
    """Whether `available()` has built and loaded the kernels in this process already. A caller whose torch path gives
    the same bits (the K/V write, `cpu_write`) takes the kernel only then: no cache builds the extension for that
    alone."""
    return _BUILD_TRIED and available()


_BUILD_TRIED = False  # whether `_build` ran in this process (`loaded` asks at every write)


@functools.cache
def _build() -> bool:
    global _BUILD_TRIED
    _BUILD_TRIED = True
    try:
        from torch.utils.cpp_extension import load

        capability = torch.backends.cpu.get_cpu_capability()
        # OpenMP: at::parallel_for's threads. No contraction of a product and a sum into one rounding: the ops that
        # reproduce torch's arithmetic (the seal, the rotary embedding) round each step as torch's separate ops do.
        flags = ["-O3", "-fopenmp", "-ffp-contract=off", *_CAPABILITY_FLAGS.get(capability, [])]
        name = f"hf_paged_cache_cpu_attention_{capability.lower() if capability in _CAPABILITY_FLAGS else 'default'}"
        load(name=name, sources=[str(source) for source in SOURCES], extra_cflags=flags, extra_ldflags=["-fopenmp"], is_python_module=False,
             verbose=False)  # fmt: skip
    except Exception as error:  # no compiler, no ninja, or a failed build: the torch path stays
        warnings.warn(f"hf_paged_cache: the CPU attention kernel was not built ({error}); using the torch path",
                      stacklevel=3)  # fmt: skip
        return False
    return True


@functools.lru_cache(maxsize=None)
def kernel_format(fmt: QuantFormat, block_size: int, head_dim: int) -> KernelFormat:
    """`fmt.kernel_format(block_size, head_dim)`, computed once (a layer asks at every step)."""
    return fmt.kernel_format(block_size, head_dim)


def reads_format(fmt: QuantFormat, block_size: int, head_dim: int) -> bool:
    """Whether the kernel decodes (and encodes) blocks of `fmt`: symmetric int8, or unrotated 4 / 2-bit codes with zero
    points, each over its whole code range (the C++ encode's: +-127, or 0 .. 2**bits - 1)."""
    kernel = kernel_format(fmt, block_size, head_dim)
    levels = 127 if kernel.bits == 8 else (1 << kernel.bits) - 1
    return (kernel.exponent_bits == 0 and not kernel.rotate and kernel.bits in (2, 4, 8)
            and kernel.zero_point == (kernel.bits != 8) and kernel.qmax == levels)  # fmt: skip


@dataclass
class QuantizedRows:
    """The sealed blocks each row reads before its full-precision ones: tokens `reads[r, 0]` .. `reads[r, 1] - 1` of
    its table `tables[r]` (ids of the pool `key_fields` / `value_fields`, as `QuantFormat.allocate` lays them out)."""

    key_format: QuantFormat
    value_format: QuantFormat
    key_fields: dict[str, torch.Tensor]
    value_fields: dict[str, torch.Tensor]
    tables: torch.Tensor  # [rows, width]
    reads: torch.Tensor  # [rows, 2]

    def arguments(self, block_size: int, head_dim: int, value_dim: int) -> tuple:
        """The op's quantized arguments: the six fields as 4-D views, the tables, the reads and the formats."""
        fields, formats = [], []
        for fmt, pool, dim in ((self.key_format, self.key_fields, head_dim),
                               (self.value_format, self.value_fields, value_dim)):  # fmt: skip
            if not reads_format(fmt, block_size, dim):
                raise ValueError(f"paged_attention_cpu cannot decode {fmt!r} (see reads_format)")
            kernel = kernel_format(fmt, block_size, dim)
            scale, zero = pool["scale"], pool["zero"] if "zero" in pool else pool["scale"].new_empty(0)
            if kernel.per_token:  # [blocks, slots, heads(, groups)]
                scale, zero = (t if t.dim() == 4 or not t.numel() else t.unsqueeze(-1) for t in (scale, zero))
            else:  # one per block: [blocks, 1, heads, groups]
                scale, zero = (t.unsqueeze(1) if t.numel() else t for t in (scale, zero))
            groups = dim // kernel.group
            fields += [pool["codes"], scale, zero]
            formats += [kernel.bits, kernel.group, groups if kernel.scale_bits == 8 else -1]
        return fields, self.tables, self.reads, formats


@dataclass
class TransitionRows:
    """The blocks each row's queries read both ways (`StepPlan.transition`), after its sealed ones: row r's are tokens
    `starts[r]` .. `starts[r + 1] - 1` of `exact` and `decoded` (keys, values) `[kv_heads, tokens, d]`, float32; a query
    reads a block's decoded tokens once the block ends at least `window` positions before the query's own + 1.
    `decoded=None`: they are the last tokens of each row's quantized read (blocks sealed as they arrived), decoded in
    the kernel."""

    exact: tuple[torch.Tensor, torch.Tensor]
    decoded: tuple[torch.Tensor, torch.Tensor] | None
    starts: torch.Tensor  # [rows + 1]
    window: int


def paged_attention_cpu(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                        query_starts: torch.Tensor, seq_lens: torch.Tensor, first_tokens: torch.Tensor,
                        scale: float, quantized: QuantizedRows | None = None,
                        transition: TransitionRows | None = None) -> torch.Tensor:  # fmt: skip
    """Row r's queries `query[query_starts[r] : query_starts[r + 1]]` (`[n, heads, d]`) are the last n of the keys it
    reads, each attending causally over them: its `quantized` tokens, its `transition` tokens, then its stored tokens
    `first_tokens[r]` .. `seq_lens[r] - 1` (token t in block `block_tables[r, t // block_size]`) of `k_cache` /
    `v_cache` `[num_blocks, block_size, kv_heads, d]`. Returns `[tokens, heads, d]` (zeros for a row that reads
    nothing). Float32 CPU tensors; call `available()` first."""
    return paged_partial_attention_cpu(query, k_cache, v_cache, block_tables, query_starts, seq_lens, first_tokens,
                                       scale, quantized, transition)[0]  # fmt: skip


def paged_partial_attention_cpu(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                block_tables: torch.Tensor, query_starts: torch.Tensor, seq_lens: torch.Tensor,
                                first_tokens: torch.Tensor, scale: float, quantized: QuantizedRows | None = None,
                                transition: TransitionRows | None = None,
                                causal: bool = True) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """`paged_attention_cpu`, and each query's log-sum-exp of the (scaled) logits it saw `[tokens, heads]` (-inf where
    it saw none), so attention over disjoint parts of the keys merges exactly (`merge_partials`). With `causal=False`
    every query of a row sees every key the row reads: decode tokens of several sequences over a prefix they share,
    read once for all of them."""
    fields, tables, reads, formats = [], None, None, []
    if quantized is not None:
        fields, tables, reads, formats = quantized.arguments(k_cache.shape[1], k_cache.shape[-1], v_cache.shape[-1])
    pairs, starts, window = [], None, 0
    if transition is not None:
        pairs, starts, window = [*transition.exact, *(transition.decoded or ())], transition.starts, transition.window
    return torch.ops.hf_paged_cache.paged_attention_cpu(query, k_cache, v_cache, block_tables, query_starts, seq_lens,
                                                        first_tokens, scale, fields, tables, reads, formats, pairs,
                                                        starts, window, causal)  # fmt: skip


def paged_attention_cpu_ref(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, query_starts: torch.Tensor, seq_lens: torch.Tensor,
                            first_tokens: torch.Tensor, scale: float, quantized: QuantizedRows | None = None,
                            transition: TransitionRows | None = None) -> torch.Tensor:  # fmt: skip
    """Reference for `paged_attention_cpu` (`paged_partial_attention_cpu_ref`'s outputs)."""
    return paged_partial_attention_cpu_ref(query, k_cache, v_cache, block_tables, query_starts, seq_lens, first_tokens,
                                           scale, quantized, transition)[0]  # fmt: skip


def paged_partial_attention_cpu_ref(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                    block_tables: torch.Tensor, query_starts: torch.Tensor, seq_lens: torch.Tensor,
                                    first_tokens: torch.Tensor, scale: float, quantized: QuantizedRows | None = None,
                                    transition: TransitionRows | None = None,
                                    causal: bool = True) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Reference for `paged_partial_attention_cpu`, row by row: the keys each query sees gathered (quantized blocks
    decoded by their format) and attended with an explicit mask."""
    out = torch.zeros(*query.shape[:2], v_cache.shape[-1], dtype=query.dtype)
    lse = torch.full(query.shape[:2], float("-inf"), dtype=query.dtype)
    bounds, block_size = query_starts.tolist(), k_cache.shape[1]
    for row, (first, stop) in enumerate(zip(first_tokens.tolist(), seq_lens.tolist())):
        begin, end = bounds[row], bounds[row + 1]
        parts = []  # (keys, values [n, kv_heads, d], kind)
        t0, t1 = (0, 0) if transition is None else (transition.starts[row].item(), transition.starts[row + 1].item())
        decoded = None if transition is None else transition.decoded
        if quantized is not None:
            q_first, q_stop = quantized.reads[row].tolist()
            if q_stop > q_first:
                ids = quantized.tables[row, : -(-q_stop // block_size)]
                keys = quantized.key_format.dequantize(quantized.key_fields, ids).flatten(0, 1)[q_first:q_stop]
                values = quantized.value_format.dequantize(quantized.value_fields, ids).flatten(0, 1)[q_first:q_stop]
                if transition is not None and decoded is None:  # the read ends with the transition's decoded tokens
                    cut = keys.shape[0] - (t1 - t0)
                    decoded = (keys[cut:].transpose(0, 1), values[cut:].transpose(0, 1))
                    keys, values = keys[:cut], values[:cut]
                    t0, t1 = 0, t1 - t0
                parts.append((keys, values, "all"))
        if transition is not None:
            own = slice(transition.starts[row].item(), transition.starts[row + 1].item())
            exact = [part[:, own] for part in transition.exact]
            decoded = decoded or (exact[0][:, :0], exact[1][:, :0])  # no quantized read: no transition either
            parts.append((decoded[0][:, t0:t1].transpose(0, 1), decoded[1][:, t0:t1].transpose(0, 1), "decoded"))
            parts.append((exact[0].transpose(0, 1), exact[1].transpose(0, 1), "exact"))
        if stop > first:
            keys = gather_kv(k_cache, block_tables[row], stop)[first:]
            values = gather_kv(v_cache, block_tables[row], stop)[first:]
            parts.append((keys, values, "all"))
        positions, kinds, at = [], [], 0
        for keys, _values, kind in parts:
            positions.append(torch.arange(at, at + keys.shape[0]))
            kinds += [kind] * keys.shape[0]
            at += 0 if kind == "decoded" else keys.shape[0]  # the exact tokens stand where the decoded ones do
        if end == begin or not at:
            continue
        key_positions = torch.cat(positions)
        # where each query stands among the keys: causally the last of them, else after every one
        query_positions = torch.arange(at - (end - begin), at) if causal else torch.full((end - begin,), at - 1)
        visible = key_positions[None, :] <= query_positions[:, None]
        if transition is not None:  # a transition block is read decoded once it ends `window` before the query + 1
            decoded_at = key_positions[torch.tensor([kind == "decoded" for kind in kinds])]
            t_begin = int(decoded_at.min()) if decoded_at.numel() else 0
            block_ends = t_begin + ((key_positions - t_begin) // block_size + 1) * block_size
            sealed = block_ends[None, :] <= query_positions[:, None] + 1 - transition.window
            decoded = torch.tensor([kind == "decoded" for kind in kinds])[None, :]
            exact = torch.tensor([kind == "exact" for kind in kinds])[None, :]
            visible &= ~(decoded & ~sealed) & ~(exact & sealed)
        keys = torch.cat([part[0] for part in parts]).float()
        values = torch.cat([part[1] for part in parts]).float()
        groups = query.shape[1] // keys.shape[1]
        logits = torch.einsum("qhd,khd->hqk", query[begin:end].float(), keys.repeat_interleave(groups, 1)) * scale
        logits = logits.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(logits, -1)
        out[begin:end] = torch.einsum("hqk,khd->qhd", probs, values.repeat_interleave(groups, 1)).to(out.dtype)
        lse[begin:end] = torch.logsumexp(logits, -1).transpose(0, 1).to(lse.dtype)
    return out, lse
