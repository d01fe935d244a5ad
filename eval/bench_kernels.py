"""GPU benchmark of the paged decode kernel and of paged end-to-end decoding (CUDA only).

Kernel cells: bf16 KV, block size 16, batch {1, 8, 32, 128} x context {1k, 4k, 16k, 32k}, for two
attention shapes (32 query / 8 KV heads / head dim 128 -- Llama-3-8B -- and 9 / 3 / 64 -- SmolLM2-135M).
Per cell: kernel time (CUDA events, after warm-up, L2 flushed before every timed call), achieved
bandwidth (KV bytes the kernel must read / time), its ratio to the measured device-to-device copy
bandwidth, and the same attention with torch SDPA over a contiguous ``[batch, kv_heads, context,
head_dim]`` cache holding the same content (plus ``flash_attn_with_kvcache`` on a contiguous
``[batch, context, kv_heads, head_dim]`` cache when flash-attn is importable). Every cell also
records the largest difference to SDPA's output. Cells that do not fit in free memory are skipped.

Quantized decode: at batch 32 x 16k context (Llama-3-8B heads), the decode kernel over a quantized
history (int4 = KIVI keys per channel / values per token, int8, fp8 e4m3; the last 128 tokens in bf16)
versus the same kernel over the bf16 cache: time, bytes read per second, speedup (issue target: int4 at
least 2.5x faster than bf16) and the largest output difference to bf16 (quantization error, for sanity).
The quantized pools are filled by the seal kernel (``quantize_blocks``), whose time is reported too.

End to end: decode tokens/s of a random-weight Llama-3-8B-shaped bf16 model at batch 32 x 4k
context, ``DynamicCache`` + sdpa versus ``PagedCache`` + the "paged" attention implementation.

    python eval/bench_kernels.py --out eval/results/bench_kernels.json   # full run
    python eval/bench_kernels.py --quick --out /tmp/smoke.json       # tiny smoke subset

Copy bandwidth counts read + write bytes (2 x tensor size per copy), so a decode kernel that only
reads would match it at ratio 1.0.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import math
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

DEVICE = "cuda"
BLOCK_SIZE = 16
SHAPES = {"32q-8kv-d128": (32, 8, 128), "9q-3kv-d64": (9, 3, 64)}
BATCHES = (1, 8, 32, 128)
CONTEXTS = (1024, 4096, 16384, 32768)
QUICK_BATCHES, QUICK_CONTEXTS = (1, 8), (1024,)
QUANT_SHAPE, QUANT_BATCH, QUANT_CONTEXT = "32q-8kv-d128", 32, 16384
QUANT_FORMATS = ("int4", "int8", "fp8_e4m3")
QUANT_RESIDUAL = 128  # most recent tokens kept in bf16, as the quantized cache keeps a full-precision window
INT4_SPEEDUP_TARGET = 2.5
L2_FLUSH_BYTES = 256 * 2**20  # larger than any current GPU's L2
SLEEP_CYCLES = 2_000_000  # ~1 ms of GPU clock: longer than the host needs to enqueue one timed call


def time_cuda(fn, warmup: int = 3, iters: int = 20, flush: torch.Tensor | None = None) -> float:
    """Median milliseconds of ``fn()`` measured with CUDA events; ``flush`` is overwritten before each call.

    Before each call the GPU is kept busy (``torch.cuda._sleep``) while the host enqueues the flush,
    the events and ``fn``'s launches, so the time is the GPU's alone, without Python launch overhead.
    """
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        torch.cuda._sleep(SLEEP_CYCLES)
        if flush is not None:
            flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def copy_bandwidth_gbps(flush: torch.Tensor) -> float:
    """Device-to-device ``tensor.copy_`` bandwidth in GB/s (read + write bytes) on a 2 GiB tensor."""
    src = torch.empty(2**30, dtype=torch.bfloat16, device=DEVICE)
    dst = torch.empty_like(src)
    ms = time_cuda(lambda: dst.copy_(src), flush=flush)
    gbps = 2 * src.numel() * src.element_size() / (ms * 1e-3) / 1e9
    del src, dst
    return gbps


def free_bytes() -> int:
    gc.collect()
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info()[0]


def sdpa_decode(q, k, v, scale):
    """SDPA for one query token per row: q [B, Hq, D], k/v [B, Hkv, L, D] -> [B, Hq, D]."""
    return F.scaled_dot_product_attention(q[:, :, None], k, v, scale=scale, enable_gqa=True)[:, :, 0]


def kernel_cell(shape_name, batch, context, copy_gbps, flush, flash_attn_with_kvcache):
    from hf_paged_cache.kernels import paged_decode_attention
    from hf_paged_cache.kernels.paged_decode import plan_paged_decode

    q_heads, kv_heads, head_dim = SHAPES[shape_name]
    cell = dict(shape=shape_name, batch=batch, context=context)
    kv_bytes = 2 * batch * context * kv_heads * head_dim * 2  # K and V, bf16
    # The pages plus one contiguous copy at a time (flash-attn's layout, then SDPA's).
    if 2 * kv_bytes * 1.1 + 2**30 > free_bytes():
        return dict(cell, skipped="does not fit in free GPU memory")

    blocks_per_row = context // BLOCK_SIZE
    num_blocks = batch * blocks_per_row
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, kv_heads, head_dim, dtype=torch.bfloat16, device=DEVICE)
    v_cache = torch.randn_like(k_cache)
    # A fragmented pool: every row's blocks are scattered at random.
    block_tables = torch.randperm(num_blocks, device=DEVICE).view(batch, blocks_per_row).int()
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=DEVICE)
    query = torch.randn(batch, q_heads, head_dim, dtype=torch.bfloat16, device=DEVICE)
    scale = head_dim**-0.5

    def dense_copy(cache, heads_first):
        """The pages' content, contiguous: [batch, kv_heads, context, head_dim] (heads_first) or
        [batch, context, kv_heads, head_dim]."""
        shape = (batch, kv_heads, context, head_dim) if heads_first else (batch, context, kv_heads, head_dim)
        out = cache.new_empty(shape)
        for b in range(batch):  # row by row: no second full-size temporary
            row = cache[block_tables[b].long()].view(context, kv_heads, head_dim)
            out[b] = row.transpose(0, 1) if heads_first else row
        return out

    args = (query, k_cache, v_cache, block_tables, seq_lens, scale)
    num_splits = plan_paged_decode(*args)[1][0].grid[1]  # what the launcher picks for this shape
    paged_ms = time_cuda(lambda: paged_decode_attention(*args), flush=flush)
    paged_out = paged_decode_attention(*args)
    gbps = kv_bytes / (paged_ms * 1e-3) / 1e9
    cell.update(
        num_splits=num_splits, paged_ms=paged_ms, paged_GBps=gbps, fraction_of_copy_bandwidth=gbps / copy_gbps
    )

    if flash_attn_with_kvcache is not None:
        k_fa, v_fa = dense_copy(k_cache, heads_first=False), dense_copy(v_cache, heads_first=False)
        cell["flash_attn_ms"] = time_cuda(
            lambda: flash_attn_with_kvcache(query[:, None], k_fa, v_fa, cache_seqlens=seq_lens, softmax_scale=scale),
            flush=flush,
        )
        del k_fa, v_fa
    k_sdpa, v_sdpa = dense_copy(k_cache, heads_first=True), dense_copy(v_cache, heads_first=True)
    del k_cache, v_cache, args
    sdpa_ms = time_cuda(lambda: sdpa_decode(query, k_sdpa, v_sdpa, scale), flush=flush)
    max_diff = (paged_out.float() - sdpa_decode(query, k_sdpa, v_sdpa, scale).float()).abs().max().item()
    cell.update(sdpa_ms=sdpa_ms, speedup_vs_sdpa=sdpa_ms / paged_ms, max_abs_diff_vs_sdpa=max_diff)
    return cell


def quantized_decode_cells(batch: int, context: int, flush: torch.Tensor) -> list[dict]:
    """bf16 paged decode, then decode over a quantized history per format (same content, same queries)."""
    from hf_paged_cache.kernels import QuantizedKV, paged_decode_attention, quantize_blocks
    from hf_paged_cache.quantization import parse_kv_format

    q_heads, kv_heads, head_dim = SHAPES[QUANT_SHAPE]
    base = dict(shape=QUANT_SHAPE, batch=batch, context=context, residual_bf16_tokens=QUANT_RESIDUAL)
    blocks_per_row = context // BLOCK_SIZE
    num_blocks = batch * blocks_per_row
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, kv_heads, head_dim, dtype=torch.bfloat16, device=DEVICE)
    v_cache = torch.randn_like(k_cache)
    block_tables = torch.randperm(num_blocks, device=DEVICE).view(batch, blocks_per_row).int()
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=DEVICE)
    query = torch.randn(batch, q_heads, head_dim, dtype=torch.bfloat16, device=DEVICE)
    scale = head_dim**-0.5
    bf16_bytes = 2 * num_blocks * BLOCK_SIZE * kv_heads * head_dim * 2

    bf16_args = (query, k_cache, v_cache, block_tables, seq_lens, scale)
    bf16_ms = time_cuda(lambda: paged_decode_attention(*bf16_args), flush=flush)
    bf16_out = paged_decode_attention(*bf16_args).float()
    cells = [dict(base, format="bf16", ms=bf16_ms, GBps=bf16_bytes / (bf16_ms * 1e-3) / 1e9)]

    sealed = blocks_per_row - QUANT_RESIDUAL // BLOCK_SIZE  # quantized blocks per row
    fp_tables = block_tables[:, sealed:].contiguous()
    for spec in QUANT_FORMATS:
        cell = dict(base, format=spec)
        try:
            kv_format = parse_kv_format(spec)
            pools = [fmt.allocate(batch * sealed, BLOCK_SIZE, kv_heads, head_dim, device=DEVICE)
                     for fmt in (kv_format.key, kv_format.value)]  # fmt: skip
            src = block_tables[:, :sealed].reshape(-1)
            dst = torch.randperm(batch * sealed, device=DEVICE).int()  # a fragmented quantized pool too
            seal = (k_cache, v_cache, src, *pools, dst, kv_format.key, kv_format.value)
            seal_ms = time_cuda(lambda: quantize_blocks(*seal), flush=flush)
            quantized = QuantizedKV(
                kv_format.key, kv_format.value, *pools, dst.view(batch, sealed),
                torch.full((batch,), sealed * BLOCK_SIZE, dtype=torch.int32, device=DEVICE),
            )  # fmt: skip
            args = (query, k_cache, v_cache, fp_tables, seq_lens, scale)
            ms = time_cuda(lambda: paged_decode_attention(*args, quantized=quantized), flush=flush)
            out = paged_decode_attention(*args, quantized=quantized).float()
            read = kv_format.bytes_per_block(BLOCK_SIZE, kv_heads, head_dim) * batch * sealed
            read += bf16_bytes * (blocks_per_row - sealed) // blocks_per_row
            cell.update(
                ms=ms, GBps=read / (ms * 1e-3) / 1e9, bytes_vs_bf16=read / bf16_bytes, speedup_vs_bf16=bf16_ms / ms,
                max_abs_diff_vs_bf16=(out - bf16_out).abs().max().item(),
                seal_ms=seal_ms, seal_GBps=bf16_bytes * sealed / blocks_per_row / (seal_ms * 1e-3) / 1e9,
            )  # fmt: skip
            if spec == "int4":
                cell["meets_target"] = cell["speedup_vs_bf16"] >= INT4_SPEEDUP_TARGET
        except Exception as exc:  # record and go on with the next format
            cell["error"] = f"{type(exc).__name__}: {exc}"
        cells.append(cell)
        print(json.dumps(cell), flush=True)
        free_bytes()
    return cells


def llama3_8b_config(num_layers: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=num_layers,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0,
    )  # fmt: skip


@torch.inference_mode()
def timed_greedy_decode(model, cache, prompt, steps):
    """Prefill ``prompt`` [batch, context], then time ``steps`` greedy decode steps.

    Returns (decode tokens/s, the ``steps`` timed tokens [batch, steps]).
    """
    # transformers renamed forward's `past_key_values` to `cache` (the old name goes in 5.40).
    cache_kwarg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    def step(ids):
        logits = model(input_ids=ids, use_cache=True, logits_to_keep=1, **{cache_kwarg: cache}).logits
        return logits[:, -1].argmax(-1, keepdim=True)

    token = step(prompt)
    warmup = 3  # includes Triton JIT compilation of the decode kernels
    tokens = []
    for i in range(warmup + steps):
        if i == warmup:
            torch.cuda.synchronize()
            start = time.perf_counter()
        token = step(token)
        tokens.append(token)
    torch.cuda.synchronize()
    return prompt.shape[0] * steps / (time.perf_counter() - start), torch.cat(tokens[warmup:], dim=1)


def end_to_end(batch, context, steps, num_layers):
    """Decode tokens/s: DynamicCache + sdpa versus PagedCache + "paged", same random-weight model and prompt.

    Also reports the fraction of timed greedy tokens on which both agree (bf16 rounding can make
    near-tied random-weight logits flip, after which the sequences differ).
    """
    from transformers import AutoModelForCausalLM, DynamicCache

    from hf_paged_cache import PagedCache

    config = llama3_8b_config(num_layers)
    result = dict(
        model="Llama-3-8B-shaped (random weights)", num_layers=num_layers, batch=batch, context=context, steps=steps
    )
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa").eval()
    prompt = torch.randint(0, config.vocab_size, (batch, context), device=DEVICE)
    dynamic = DynamicCache(config=config)
    result["dynamic_sdpa_tokens_per_s"], dynamic_tokens = timed_greedy_decode(model, dynamic, prompt, steps)
    del dynamic
    free_bytes()

    model.set_attn_implementation("paged")
    num_blocks = batch * math.ceil((context + steps + 4) / BLOCK_SIZE) + 16  # + warm-up steps, small slack
    cache = PagedCache(model.config, block_size=BLOCK_SIZE, num_blocks=num_blocks)
    result["paged_tokens_per_s"], paged_tokens = timed_greedy_decode(model, cache, prompt, steps)
    result["speedup"] = result["paged_tokens_per_s"] / result["dynamic_sdpa_tokens_per_s"]
    result["greedy_tokens_agreeing"] = (paged_tokens == dynamic_tokens).float().mean().item()
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="write results to this JSON file")
    parser.add_argument("--quick", action="store_true", help="tiny smoke subset (seconds)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_kernels.py measures GPU kernels and needs CUDA, which is unavailable here: nothing to do.")
        return 0

    import triton

    try:
        from flash_attn import flash_attn_with_kvcache
    except ImportError:
        flash_attn_with_kvcache = None
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device=DEVICE)
    results = dict(
        device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
        python=platform.python_version(), flash_attn=flash_attn_with_kvcache is not None, quick=args.quick,
    )  # fmt: skip
    results["copy_bandwidth_GBps"] = copy_bandwidth_gbps(flush)
    print(f"{results['device']}: device-to-device copy {results['copy_bandwidth_GBps']:.0f} GB/s", flush=True)

    batches, contexts = (QUICK_BATCHES, QUICK_CONTEXTS) if args.quick else (BATCHES, CONTEXTS)
    results["kernels"] = []
    for shape_name in SHAPES:
        for batch in batches:
            for context in contexts:
                try:
                    cell = kernel_cell(
                        shape_name, batch, context, results["copy_bandwidth_GBps"], flush, flash_attn_with_kvcache
                    )
                except torch.OutOfMemoryError:
                    cell = dict(shape=shape_name, batch=batch, context=context, skipped="out of memory")
                except Exception as exc:  # record and go on: one broken cell must not lose the others
                    cell = dict(shape=shape_name, batch=batch, context=context, error=f"{type(exc).__name__}: {exc}")
                results["kernels"].append(cell)
                print(json.dumps(cell), flush=True)
                free_bytes()

    batch, context = (4, 1024) if args.quick else (QUANT_BATCH, QUANT_CONTEXT)
    try:
        results["quantized_decode"] = quantized_decode_cells(batch, context, flush)
    except Exception as exc:  # keep the other results
        results["quantized_decode"] = dict(error=f"{type(exc).__name__}: {exc}")
    free_bytes()

    if args.quick:
        e2e = dict(batch=4, context=512, steps=8, num_layers=2)
    else:
        e2e = dict(batch=32, context=4096, steps=64, num_layers=32)
    try:
        results["end_to_end"] = end_to_end(**e2e)
    except Exception as exc:  # the paged cache API may be missing or broken: keep the kernel results
        results["end_to_end"] = dict(e2e, error=f"{type(exc).__name__}: {exc}")
    print(json.dumps(results["end_to_end"]), flush=True)

    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=2))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
