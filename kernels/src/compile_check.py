"""Compile every kernel variant for NVIDIA GPUs on a machine that has none.

The Triton interpreter runs the kernels on CPU for the tests but does not check what only the GPU
compiler rejects (tl.dot shapes below 16, loop-carried dtype changes, ...), nor register pressure.
This module builds each variant's launches exactly as the launchers do (``variants.example_launches``),
compiles them with ``triton.compile`` for sm80 and sm90 down to a cubin (the triton wheel ships ptxas),
and prints one line per variant with registers, spill bytes per thread and shared memory, read from
the cubin with the wheel's ``cuobjdump --dump-resource-usage`` (the kernels make no calls and declare
no local arrays, so any STACK or LOCAL bytes are register spills). Exits 1 if any variant fails.

    python -m hf_paged_cache.kernels.compile_check                 # everything: 1600 compiles
    python -m hf_paged_cache.kernels.compile_check --dtypes bf16 --head-dims 80 --archs 90
    python -m hf_paged_cache.kernels.compile_check --formats int4 K4V2 --archs 90   # quantized variants only
    python -m hf_paged_cache.kernels.compile_check --formats none                    # unquantized variants only

Must run with TRITON_INTERPRET unset. The signature mirrors the JIT's default specialisation (pointers
and integers divisible by 16 are marked so); other value specialisations the JIT may apply at run
time only ever make the compiled code simpler.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor

import torch

_DTYPE_NAMES = {
    torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.int32: "i32", torch.int64: "i64",
    torch.int8: "i8", torch.uint8: "u8",
}
UNQUANTIZED = "none"  # the --formats value of the unquantized variants
_RESOURCE_RE = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")


def compile_job(launch) -> tuple:
    """A picklable description of a launch's compilation.

    (kernel module, kernel name, signature, constexprs, attrs, options), typed the way the JIT types arguments.
    """
    kernel = launch.kernel
    signature, constexprs, attrs = {}, dict(launch.constexprs), {}
    for index, name in enumerate(kernel.arg_names):
        if name in launch.constexprs:
            signature[name] = "constexpr"
            continue
        value = launch.args[name]
        if value is None:  # an unused optional pointer: the JIT turns None into a constexpr
            signature[name], constexprs[name] = "constexpr", None
        elif isinstance(value, torch.Tensor):
            signature[name] = "*" + _DTYPE_NAMES[value.dtype]
            attrs[(index,)] = [["tt.divisibility", 16]]  # torch allocations are 16-byte aligned
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            signature[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            if value % 16 == 0:
                attrs[(index,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            raise TypeError(f"{kernel.__name__}: cannot type argument {name}={value!r}")
    options = dict(num_warps=launch.num_warps, num_stages=launch.num_stages)
    return kernel.fn.__module__, kernel.__name__, signature, constexprs, attrs, options


def compile_and_measure(job: tuple, arch: int) -> tuple[int, int, int]:
    """Compile one job for sm<arch>; return (registers, spill bytes per thread, shared memory bytes)."""
    import importlib

    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    module, name, signature, constexprs, attrs, options = job
    kernel = getattr(importlib.import_module(module), name)
    compiled = triton.compile(
        ASTSource(kernel, signature, constexprs, attrs), target=GPUTarget("cuda", arch, 32), options=options
    )
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        dump = subprocess.run(
            [knobs.nvidia.cuobjdump.path, "--dump-resource-usage", cubin.name],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
    regs, stack, shared, local = map(int, _RESOURCE_RE.search(dump).groups())
    return regs, stack + local, shared


def _describe(label: str, dtype: torch.dtype, constexprs: dict) -> str:
    shown = " ".join(f"{k}={v}" for k, v in constexprs.items() if v is not None)
    return f"{label:<13} {_DTYPE_NAMES[dtype]:<4} {shown}"


def collect_jobs(dtypes, head_dims, block_sizes, groups, formats=(UNQUANTIZED,)) -> list[tuple[str, tuple]]:
    """Unique (description, job) pairs over the variant grids (e.g. write_kv does not depend on the group).

    ``formats``: UNQUANTIZED selects the unquantized grid; KV format specs select quantized variants on the
    quantized grid, intersected with the other axes (``variants.quantized_grid``).
    """
    from . import variants

    points = []
    if UNQUANTIZED in formats:
        unquantized = variants.grid(dtypes, head_dims, block_sizes, groups)
        points += [(variants.example_launches, point[0], point) for point in unquantized]
    quantized = variants.quantized_grid(
        [f for f in formats if f != UNQUANTIZED], [d for d in dtypes if d in variants.QUANT_DTYPES],
        [h for h in head_dims if h in variants.QUANT_HEAD_DIMS], block_sizes,
        [g for g in groups if g in variants.QUANT_GROUPS],
    )  # fmt: skip
    points += [(variants.quantized_example_launches, point[1], point) for point in quantized]
    jobs = {}
    for example_launches, dtype, point in points:
        for label, launch in example_launches(*point):
            job = compile_job(launch)
            key = repr(job)
            if key not in jobs:
                jobs[key] = (_describe(label, dtype, job[3]), job)
    return list(jobs.values())


def _worker(args):
    description, job, arch = args
    try:
        return description, arch, compile_and_measure(job, arch), None
    except Exception as exc:  # report every failing variant, not just the first
        last_line = str(exc).strip().splitlines()[-1:] or [""]
        return description, arch, None, f"{type(exc).__name__}: {last_line[0]}"


def main(argv=None) -> int:
    from . import variants

    by_name = {name: dtype for dtype, name in _DTYPE_NAMES.items() if dtype in variants.DTYPES}
    parser = argparse.ArgumentParser(
        prog="python -m hf_paged_cache.kernels.compile_check", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--dtypes", nargs="+", choices=list(by_name), default=list(by_name))
    parser.add_argument("--head-dims", nargs="+", type=int, default=list(variants.HEAD_DIMS))
    parser.add_argument("--block-sizes", nargs="+", type=int, default=list(variants.BLOCK_SIZES))
    parser.add_argument("--groups", nargs="+", type=int, default=sorted({*variants.GROUPS, *variants.QUANT_GROUPS}))
    formats = [UNQUANTIZED, *variants.QUANT_FORMATS]
    parser.add_argument("--formats", nargs="+", choices=formats, default=formats, help="KV storage formats")
    parser.add_argument("--archs", nargs="+", type=int, default=[80, 90])
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="parallel compiler processes")
    args = parser.parse_args(argv)

    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("compile_check compiles for the GPU: run it with TRITON_INTERPRET unset", file=sys.stderr)
        return 2
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

    start = time.time()
    dtypes = [by_name[name] for name in args.dtypes]
    jobs = collect_jobs(dtypes, args.head_dims, args.block_sizes, args.groups, args.formats)
    work = [(description, job, arch) for arch in args.archs for description, job in jobs]
    max_regs, spilling, failures = {}, [], []
    # fork: workers inherit the imported kernel modules; each compile is independent.
    with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("fork")) as pool:
        for description, arch, usage, error in pool.map(_worker, work):
            if error is not None:
                failures.append(description)
                print(f"sm{arch} FAIL  {description}\n      {error}", flush=True)
                continue
            regs, spill, shared = usage
            label = description.split()[0]
            max_regs[label] = max(max_regs.get(label, 0), regs)
            if spill:
                spilling.append(description)
            print(f"sm{arch} regs={regs:<3} spill={spill:<5} smem={shared:<6} {description}", flush=True)
    print(
        f"\n{len(work)} variants ({len(jobs)} per arch x {len(args.archs)} archs) in {time.time() - start:.0f} s: "
        f"max registers {max(max_regs.values(), default=0)}, {len(spilling)} spilling, {len(failures)} failed\n"
        f"max registers per kernel: {', '.join(f'{label} {regs}' for label, regs in sorted(max_regs.items()))}"
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
