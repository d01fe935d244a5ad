"""The kernels run under the interpreter even if triton was imported before TRITON_INTERPRET was set.

``import transformers`` imports triton; triton's own @jit helpers (tl.max, tl.sum, ...) are then
compiled-mode functions that the interpreter cannot call, so the kernels must not use them (see
kernels/src/common.py). Checked in a fresh process, where the import order is under control.
"""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

SCRIPT = textwrap.dedent(
    """
    import os
    import torch
    import triton  # first, as `import transformers` does
    os.environ["TRITON_INTERPRET"] = "1"
    from hf_paged_cache.kernels import (
        paged_decode_attention, paged_decode_attention_ref, paged_prefill_attention, paged_prefill_attention_ref,
    )

    torch.manual_seed(0)
    k_cache, v_cache = torch.randn(4, 16, 1, 32), torch.randn(4, 16, 1, 32)
    tables = torch.tensor([[2, 0], [3, 1]], dtype=torch.int32)
    seq_lens = torch.tensor([20, 5], dtype=torch.int32)
    query = torch.randn(2, 4, 32)
    args = (k_cache, v_cache, tables, seq_lens, 0.2)
    expected = paged_decode_attention_ref(query, *args)
    torch.testing.assert_close(paged_decode_attention(query, *args, num_splits=2), expected)
    query = torch.randn(2, 3, 4, 32)
    args = (k_cache, v_cache, tables, seq_lens, torch.tensor([3, 2], dtype=torch.int32), 0.2)
    torch.testing.assert_close(paged_prefill_attention(query, *args), paged_prefill_attention_ref(query, *args))
    print("ok")
    """
)


@pytest.mark.skipif(torch.cuda.is_available(), reason="concerns the CPU interpreter")
def test_kernels_interpret_after_triton_was_imported():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    result = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stdout + result.stderr
