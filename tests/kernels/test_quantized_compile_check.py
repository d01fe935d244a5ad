"""The quantized variant grid, and compile_check on one point of it: the quantized variants compile for sm90
(ptxas, no GPU) without spilling. compile_check runs in a subprocess, because this process imported the
kernels under the interpreter.
"""

import itertools
import os
import subprocess
import sys

import pytest
from test_compile_check import ptxas_available

from hf_paged_cache.kernels import variants


@pytest.mark.skipif(not ptxas_available(), reason="triton's CUDA backend / ptxas is unavailable")
def test_quantized_compile_check_subset():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    result = subprocess.run(
        [sys.executable, "-m", "hf_paged_cache.kernels.compile_check", "--formats", "K4V2",
         "--dtypes", "bf16", "--head-dims", "128", "--block-sizes", "16", "--groups", "8", "--archs", "90"],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    lines = [line for line in result.stdout.splitlines() if line.startswith("sm90 ")]
    # qdecode, qdecode_split, reduce_splits, qprefill and seal; no unquantized variant
    assert len(lines) == 5, result.stdout
    assert all("spill=0 " in line for line in lines), result.stdout
    assert "K_BITS=4" in result.stdout and "V_BITS=2" in result.stdout


def test_quantized_grid_covers_every_format_and_pair_of_axis_values():
    points = list(variants.quantized_grid())
    assert {p[0] for p in points} == set(variants.QUANT_FORMATS)
    axes = (variants.QUANT_DTYPES, variants.QUANT_HEAD_DIMS, variants.BLOCK_SIZES, variants.QUANT_GROUPS)
    for (i, axis_i), (j, axis_j) in itertools.combinations(enumerate(axes, start=1), 2):
        assert {(p[i], p[j]) for p in points} == set(itertools.product(axis_i, axis_j))
    for kv_format in variants.QUANT_FORMATS:  # each format meets every value of every axis
        own = [p for p in points if p[0] == kv_format]
        assert all({p[i] for p in own} == set(axis) for i, axis in enumerate(axes, start=1))
