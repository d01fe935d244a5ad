"""Every quantized format through every read path of the batch generator: format x backend x fused / unfused
decoder layers x sealed / unsealed blocks. Each cell gives the tokens of each prompt generated alone with the same
format, so a format cannot silently lose a path (as int2 and fp8 once lost the fused layers' narrowed last layer:
its one query per sequence read a chunk's transition blocks with no mask)."""

from __future__ import annotations

import dataclasses
import functools

import pytest
from batch_workloads import alone, random_prompts, tiny_model

from hf_paged_cache import PagedCache, generate_batch, paged_attention, quantization
from hf_paged_cache.config import BACKENDS
from hf_paged_cache.read_paths import quantized as quantized_read
from hf_paged_cache.read_paths import selector
from hf_paged_cache.quantization import QuantFormat, format_from_spec

# One spec per shape of read: per-token int8, per-channel int4 / int2 keys, rotated and unrotated 2-bit sides, mixed
# widths, both fp8 encodings.
SPECS = ["int8", "int4", "int2", "K4V2", "K2rV2r", "fp8", "fp8_e5m2"]
PROMPTS = random_prompts((13, 6), seed=2)
NEW = 2
# residual_length 0 seals every full block, and a chunk of 8 tokens in blocks of 4 reads blocks it seals both ways;
# a residual window longer than every sequence seals none.
SEALING = {"sealed": 0, "unsealed": 32}


@functools.lru_cache(maxsize=None)
def _alone(spec: str, residual: int) -> tuple[tuple[int, ...], ...]:
    model = tiny_model("llama_gqa")
    options = dict(block_size=4, quant=spec, residual_length=residual, backend="torch")
    return tuple(tuple(alone(model, prompt, PagedCache(model.config, **options), "paged")[:NEW]) for prompt in PROMPTS)


def test_the_matrix_covers_every_format_class_the_package_ships():
    shipped = {cls for cls in map(functools.partial(getattr, quantization), quantization.__all__)
               if isinstance(cls, type) and issubclass(cls, QuantFormat) and dataclasses.is_dataclass(cls)}  # fmt: skip
    covered = {type(side) for spec in SPECS for side in (format_from_spec(spec).key, format_from_spec(spec).value)}
    assert shipped <= covered


@pytest.mark.parametrize("sealing", SEALING)
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("spec", SPECS)
def test_every_format_serves_through_every_path(spec, backend, fused, sealing):
    """`backend="triton"` runs the kernels under Triton's interpreter here; `onednn=False` turns the fused layers off.
    Prompts of 13 and 6 tokens in chunks of at most 8: chunks from scratch and after stored tokens, then decodes."""
    outputs = generate_batch(tiny_model("llama_gqa"), PROMPTS, max_new_tokens=NEW, block_size=4, max_batch_tokens=8,
                             quant=spec, residual_length=SEALING[sealing], backend=backend, onednn=fused)  # fmt: skip
    assert [output.error for output in outputs] == [None] * len(PROMPTS)
    assert tuple(tuple(output.generated_tokens) for output in outputs) == _alone(spec, SEALING[sealing])


@pytest.mark.parametrize("sealing", SEALING)
def test_the_sealed_cells_read_transition_blocks(sealing, monkeypatch):
    """What the sealed cells rely on: the torch path sees steps that read blocks they seal both ways (the read the
    narrowed last layer lost); the unsealed cells see none."""
    seen = []

    def recorded(layer, query, plan, *args):
        seen.append(any(plan.transition))
        return quantized_read.attend(layer, query, plan, *args)

    monkeypatch.setitem(paged_attention._TORCH_PATHS, selector.QUANTIZED, recorded)
    generate_batch(tiny_model("llama_gqa"), PROMPTS, max_new_tokens=NEW, block_size=4, max_batch_tokens=8, quant="int2",
                   residual_length=SEALING[sealing], backend="torch")  # fmt: skip
    assert any(seen) == (sealing == "sealed")
