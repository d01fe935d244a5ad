"""Models, prompts and reference runs shared by the batch generator's tests."""

from __future__ import annotations

import functools

import torch
from tiny_models import MODELS_BY_NAME, VOCAB

from hf_paged_cache.serving.generator import BatchGenerator, generate_batch

NEW = 6


@functools.lru_cache(maxsize=None)
def tiny_model(name: str):
    model, _config = MODELS_BY_NAME[name].build()
    return model


def random_prompts(lengths, seed: int = 0, prefix: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    shared = torch.randint(3, VOCAB, (prefix,), generator=generator).tolist()
    return [shared + torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in lengths]


def alone(model, prompt: list[int], cache, attention: str) -> list[int]:
    model.set_attn_implementation(attention)
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, max_new_tokens=NEW, do_sample=False)
    return out[0, len(prompt) :].tolist()


PRESSURE = (20, 33, 12, 41, 27, 18)  # with 12 new tokens in blocks of 4: 58 blocks in all, the largest 14


def unconstrained(name: str, prefix: int = 0, **options) -> tuple[tuple[int, ...], ...]:
    outputs = generate_batch(tiny_model(name), random_prompts(PRESSURE, seed=9, prefix=prefix), max_new_tokens=12,
                             block_size=4, max_batch_tokens=16, **options)  # fmt: skip
    return tuple(tuple(o.generated_tokens) for o in outputs)


def pressure_run(name: str = "llama_gqa", check=None, **options) -> tuple[BatchGenerator, tuple]:
    """The pressure workload with the pool at a quarter of its demand; `check(generator, batch)` runs before every
    forward."""
    generator = BatchGenerator(tiny_model(name), max_new_tokens=12, block_size=4, max_batch_tokens=16, num_blocks=15,
                               prefix_caching=False, preemption="swap", **options)  # fmt: skip
    if check is not None:
        generator.before_forward.append(lambda batch: check(generator, batch))
    for prompt in random_prompts(PRESSURE, seed=9):
        generator.add_request(prompt)
    return generator, tuple(tuple(o.generated_tokens) for o in generator.run())


def clean_run(prompts, **options) -> list:
    return generate_batch(tiny_model("llama_gqa"), prompts, block_size=4, max_batch_tokens=16, **options)


def failing(method, fails_at, error, when=lambda *args: True):
    """`method` that raises `error` at its `fails_at`-th call for which `when(*args)` holds, once."""
    calls = []

    def wrapper(*args, **kwargs):
        if when(*args):
            calls.append(None)
            if len(calls) == fails_at:
                raise error
        return method(*args, **kwargs)

    return wrapper
