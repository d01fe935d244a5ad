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

Prefill: the paged prefill kernel over whole prompts (every query of a row attends causally to the
row's stored prompt) versus SDPA (``is_causal``) on the same content, contiguous, plus
``flash_attn_func`` when flash-attn is importable: time, TFLOP/s, largest difference to SDPA.

End to end: decode tokens/s of a random-weight Llama-3-8B-shaped bf16 model at batch 32 x 4k
context, ``DynamicCache`` + sdpa versus ``PagedCache`` + the "paged" attention implementation.

    python eval/bench_kernels.py --out eval/results/bench_kernels.json   # full run
    python eval/bench_kernels.py --quick --out /tmp/smoke.json       # tiny smoke subset
    python eval/bench_kernels.py --cells 32q-8kv-d128:32x4096 32q-8kv-d128:1x32768 --quant-cell 32x4096 \
        --quant-formats int4 --prefill-cells 32q-8kv-d128:1x4096 --out cut.json   # a cut (eval/gpu_check.sh)

Cells are ``SHAPE:BATCHxCONTEXT`` (``--quant-cell`` and ``--e2e``: ``BATCHxCONTEXT``), contexts a multiple of
the block size. The JSON file is rewritten after every section, so a run stopped early keeps what it measured.
Without CUDA nothing is measured; ``--out`` then records why.

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
QUANT_SHAPE, QUANT_CELL, QUICK_QUANT_CELL = "32q-8kv-d128", "32x16384", "4x1024"
PREFILL_CELLS = ("32q-8kv-d128:1x4096", "32q-8kv-d128:1x16384", "32q-8kv-d128:8x4096", "9q-3kv-d64:8x4096")
QUICK_PREFILL_CELLS = ("32q-8kv-d128:1x512", "9q-3kv-d64:2x512")
E2E = dict(batch=32, context=4096, steps=64, num_layers=32)
QUICK_E2E = dict(batch=4, context=512, steps=8, num_layers=2)
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


def batch_context(text: str) -> tuple[int, int]:
    """``"32x4096"`` -> (32, 4096): a positive batch and a context that fills whole blocks."""
    batch, sep, context = text.partition("x")
    if not (sep and batch.isdigit() and context.isdigit() and int(batch) > 0 and int(context) > 0):
        raise argparse.ArgumentTypeError(f"{text!r} is not BATCHxCONTEXT, e.g. 32x4096")
    if int(context) % BLOCK_SIZE:
        raise argparse.ArgumentTypeError(f"{text!r}: the context must be a multiple of the block size {BLOCK_SIZE}")
    return int(batch), int(context)


def shape_cell(text: str) -> tuple[str, int, int]:
    """``"32q-8kv-d128:32x4096"`` -> (shape name, batch, context)."""
    shape, sep, rest = text.partition(":")
    if not sep or shape not in SHAPES:
        raise argparse.ArgumentTypeError(f"{text!r} is not SHAPE:BATCHxCONTEXT with SHAPE one of {', '.join(SHAPES)}")
    try:
        return (shape, *batch_context(rest))
    except argparse.ArgumentTypeError as error:
        raise argparse.ArgumentTypeError(f"{text!r}: {error}") from None


def random_paged_kv(shape_name: str, batch: int, context: int):
    """bf16 K/V of ``batch`` rows of ``context`` tokens in a fragmented pool (every row's blocks scattered at
    random): (k_cache, v_cache, block_tables, seq_lens)."""
    _, kv_heads, head_dim = SHAPES[shape_name]
    blocks_per_row = context // BLOCK_SIZE
    num_blocks = batch * blocks_per_row
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, kv_heads, head_dim, dtype=torch.bfloat16, device=DEVICE)
    v_cache = torch.randn_like(k_cache)
    block_tables = torch.randperm(num_blocks, device=DEVICE).view(batch, blocks_per_row).int()
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=DEVICE)
    return k_cache, v_cache, block_tables, seq_lens


def dense_copy(cache, block_tables, heads_first: bool):
    """The pages' content, contiguous: [batch, kv_heads, context, head_dim] (heads_first) or
    [batch, context, kv_heads, head_dim]."""
    batch, blocks_per_row = block_tables.shape
    _, block_size, kv_heads, head_dim = cache.shape
    context = blocks_per_row * block_size
    shape = (batch, kv_heads, context, head_dim) if heads_first else (batch, context, kv_heads, head_dim)
    out = cache.new_empty(shape)
    for b in range(batch):  # row by row: no second full-size temporary
        row = cache[block_tables[b].long()].view(context, kv_heads, head_dim)
        out[b] = row.transpose(0, 1) if heads_first else row
    return out


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

    k_cache, v_cache, block_tables, seq_lens = random_paged_kv(shape_name, batch, context)
    query = torch.randn(batch, q_heads, head_dim, dtype=torch.bfloat16, device=DEVICE)
    scale = head_dim**-0.5
    args = (query, k_cache, v_cache, block_tables, seq_lens, scale)
    num_splits = plan_paged_decode(*args)[1][0].grid[1]  # what the launcher picks for this shape
    paged_ms = time_cuda(lambda: paged_decode_attention(*args), flush=flush)
    paged_out = paged_decode_attention(*args)
    gbps = kv_bytes / (paged_ms * 1e-3) / 1e9
    cell.update(
        num_splits=num_splits, paged_ms=paged_ms, paged_GBps=gbps, fraction_of_copy_bandwidth=gbps / copy_gbps
    )

    if flash_attn_with_kvcache is not None:
        k_fa, v_fa = (dense_copy(cache, block_tables, heads_first=False) for cache in (k_cache, v_cache))
        cell["flash_attn_ms"] = time_cuda(
            lambda: flash_attn_with_kvcache(query[:, None], k_fa, v_fa, cache_seqlens=seq_lens, softmax_scale=scale),
            flush=flush,
        )
        del k_fa, v_fa
    k_sdpa, v_sdpa = (dense_copy(cache, block_tables, heads_first=True) for cache in (k_cache, v_cache))
    del k_cache, v_cache, args
    sdpa_ms = time_cuda(lambda: sdpa_decode(query, k_sdpa, v_sdpa, scale), flush=flush)
    max_diff = (paged_out.float() - sdpa_decode(query, k_sdpa, v_sdpa, scale).float()).abs().max().item()
    cell.update(sdpa_ms=sdpa_ms, speedup_vs_sdpa=sdpa_ms / paged_ms, max_abs_diff_vs_sdpa=max_diff)
    return cell


def quantized_decode_cells(batch: int, context: int, formats, flush: torch.Tensor) -> list[dict]:
    """bf16 paged decode, then decode over a quantized history per format (same content, same queries)."""
    from hf_paged_cache.kernels import QuantizedKV, paged_decode_attention, quantize_blocks
    from hf_paged_cache.quantization import format_from_spec

    q_heads, kv_heads, head_dim = SHAPES[QUANT_SHAPE]
    base = dict(shape=QUANT_SHAPE, batch=batch, context=context, residual_bf16_tokens=QUANT_RESIDUAL)
    blocks_per_row = context // BLOCK_SIZE
    k_cache, v_cache, block_tables, seq_lens = random_paged_kv(QUANT_SHAPE, batch, context)
    query = torch.randn(batch, q_heads, head_dim, dtype=torch.bfloat16, device=DEVICE)
    scale = head_dim**-0.5
    bf16_bytes = 2 * k_cache.numel() * k_cache.element_size()

    bf16_args = (query, k_cache, v_cache, block_tables, seq_lens, scale)
    bf16_ms = time_cuda(lambda: paged_decode_attention(*bf16_args), flush=flush)
    bf16_out = paged_decode_attention(*bf16_args).float()
    cells = [dict(base, format="bf16", ms=bf16_ms, GBps=bf16_bytes / (bf16_ms * 1e-3) / 1e9)]

    sealed = blocks_per_row - QUANT_RESIDUAL // BLOCK_SIZE  # quantized blocks per row
    fp_tables = block_tables[:, sealed:].contiguous()
    for spec in formats:
        cell = dict(base, format=spec)
        try:
            kv_format = format_from_spec(spec)
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


def prefill_cell(shape_name, batch, context, flush, flash_attn_func):
    """Whole-prompt causal attention: the paged prefill kernel vs SDPA (and flash-attn) on the same content."""
    from hf_paged_cache.kernels import paged_prefill_attention

    q_heads, kv_heads, head_dim = SHAPES[shape_name]
    cell = dict(shape=shape_name, batch=batch, context=context)
    kv_bytes = 2 * batch * context * kv_heads * head_dim * 2
    q_bytes = batch * context * q_heads * head_dim * 2
    if 2 * kv_bytes + 3 * q_bytes + 2**30 > free_bytes():  # pages, a contiguous copy, query / outputs
        return dict(cell, skipped="does not fit in free GPU memory")
    flop = 2 * 2 * batch * q_heads * head_dim * context * (context + 1) / 2  # QK^T and PV over the causal half

    k_cache, v_cache, block_tables, seq_lens = random_paged_kv(shape_name, batch, context)
    query = torch.randn(batch, context, q_heads, head_dim, dtype=torch.bfloat16, device=DEVICE)
    scale = head_dim**-0.5
    args = (query, k_cache, v_cache, block_tables, seq_lens, seq_lens, scale)  # every stored token is a query
    paged_ms = time_cuda(lambda: paged_prefill_attention(*args), flush=flush)
    paged_out = paged_prefill_attention(*args).float()
    cell.update(paged_ms=paged_ms, paged_TFLOPs=flop / (paged_ms * 1e-3) / 1e12)

    k_dense, v_dense = (dense_copy(cache, block_tables, heads_first=False) for cache in (k_cache, v_cache))
    del k_cache, v_cache, args
    if flash_attn_func is not None:
        cell["flash_attn_ms"] = time_cuda(
            lambda: flash_attn_func(query, k_dense, v_dense, softmax_scale=scale, causal=True), flush=flush
        )
    q_t, k_t, v_t = (t.transpose(1, 2) for t in (query, k_dense, v_dense))  # [batch, heads, context, head_dim]

    def sdpa():
        return F.scaled_dot_product_attention(q_t, k_t, v_t, scale=scale, is_causal=True, enable_gqa=True)

    sdpa_ms = time_cuda(sdpa, flush=flush)
    max_diff = (paged_out - sdpa().transpose(1, 2).float()).abs().max().item()
    cell.update(sdpa_ms=sdpa_ms, speedup_vs_sdpa=sdpa_ms / paged_ms, max_abs_diff_vs_sdpa=max_diff)
    return cell


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


def save(results: dict, out: str | None) -> None:
    if out:
        path = Path(out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(results, indent=2))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="write results to this JSON file")
    parser.add_argument("--quick", action="store_true", help="tiny smoke subset (seconds): the defaults below shrink")
    parser.add_argument("--cells", nargs="+", type=shape_cell, metavar="SHAPE:BATCHxCONTEXT",
                        help="decode kernel cells (default: every shape x batch {1, 8, 32, 128} x context {1k..32k})")
    parser.add_argument("--quant-cell", type=batch_context, metavar="BATCHxCONTEXT",
                        help=f"quantized decode cell ({QUANT_SHAPE}; default {QUANT_CELL})")
    parser.add_argument("--quant-formats", nargs="+", choices=QUANT_FORMATS, default=list(QUANT_FORMATS))
    parser.add_argument("--prefill-cells", nargs="+", type=shape_cell, metavar="SHAPE:BATCHxCONTEXT",
                        help=f"prefill cells (default {' '.join(PREFILL_CELLS)})")
    parser.add_argument("--e2e", type=batch_context, metavar="BATCHxCONTEXT",
                        help=f"end-to-end decode batch x context (default {E2E['batch']}x{E2E['context']})")
    parser.add_argument("--e2e-steps", type=int, help=f"timed decode steps (default {E2E['steps']})")
    parser.add_argument("--e2e-layers", type=int, help=f"decoder layers (default {E2E['num_layers']}, Llama-3-8B's)")
    parser.add_argument("--skip", nargs="+", default=[], choices=["kernels", "quantized", "prefill", "end_to_end"],
                        help="sections to leave out")
    args = parser.parse_args(argv)
    quick = args.quick
    cells = args.cells or [(shape, batch, context) for shape in SHAPES
                           for batch in (QUICK_BATCHES if quick else BATCHES)
                           for context in (QUICK_CONTEXTS if quick else CONTEXTS)]  # fmt: skip
    quant_cell = args.quant_cell or batch_context(QUICK_QUANT_CELL if quick else QUANT_CELL)
    prefill_cells = args.prefill_cells or [shape_cell(c) for c in (QUICK_PREFILL_CELLS if quick else PREFILL_CELLS)]
    e2e = dict(QUICK_E2E if quick else E2E)
    if args.e2e:
        e2e["batch"], e2e["context"] = args.e2e
    e2e["steps"] = args.e2e_steps or e2e["steps"]
    e2e["num_layers"] = args.e2e_layers or e2e["num_layers"]
    if not torch.cuda.is_available():
        print("bench_kernels.py measures GPU kernels and needs CUDA, which is unavailable here: nothing to do.")
        save(dict(skipped="CUDA is unavailable", cells=cells, quant_cell=quant_cell, prefill_cells=prefill_cells,
                  end_to_end=e2e), args.out)  # fmt: skip
        return 0

    import triton

    try:
        from flash_attn import flash_attn_func, flash_attn_with_kvcache
    except ImportError:
        flash_attn_func = flash_attn_with_kvcache = None
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device=DEVICE)
    results = dict(
        device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
        python=platform.python_version(), flash_attn=flash_attn_with_kvcache is not None, quick=quick,
    )  # fmt: skip
    results["copy_bandwidth_GBps"] = copy_bandwidth_gbps(flush)
    print(f"{results['device']}: device-to-device copy {results['copy_bandwidth_GBps']:.0f} GB/s", flush=True)
    save(results, args.out)

    if "kernels" not in args.skip:
        results["kernels"] = []
        for shape_name, batch, context in cells:
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
            save(results, args.out)
            free_bytes()

    if "quantized" not in args.skip:
        try:
            results["quantized_decode"] = quantized_decode_cells(*quant_cell, args.quant_formats, flush)
        except Exception as exc:  # keep the other results
            results["quantized_decode"] = dict(error=f"{type(exc).__name__}: {exc}")
        save(results, args.out)
        free_bytes()

    if "prefill" not in args.skip:
        results["prefill"] = []
        for shape_name, batch, context in prefill_cells:
            try:
                cell = prefill_cell(shape_name, batch, context, flush, flash_attn_func)
            except torch.OutOfMemoryError:
                cell = dict(shape=shape_name, batch=batch, context=context, skipped="out of memory")
            except Exception as exc:  # record and go on
                cell = dict(shape=shape_name, batch=batch, context=context, error=f"{type(exc).__name__}: {exc}")
            results["prefill"].append(cell)
            print(json.dumps(cell), flush=True)
            save(results, args.out)
            free_bytes()

    if "end_to_end" not in args.skip:
        try:
            results["end_to_end"] = end_to_end(**e2e)
        except Exception as exc:  # the paged cache API may be missing or broken: keep the kernel results
            results["end_to_end"] = dict(e2e, error=f"{type(exc).__name__}: {exc}")
        print(json.dumps(results["end_to_end"]), flush=True)
        save(results, args.out)
    if args.out:
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
