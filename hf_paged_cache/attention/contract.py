"""What the `"paged"` attention honours, and the clear refusal of what it does not.

transformers hands an attention function every keyword its model passes, and the paged attention reads only the
ones it knows: any other that changes the attention (a T5-style `position_bias`) would be dropped and the tokens
would differ from `DynamicCache` without an error. So each keyword is either honoured (listed here with why, learned
sink logits `s_aux` among them) or refused, and model features that show in the config are refused before the cache
changes. KV-shared layers (Gemma-3n) read their producer layer's blocks (`kv_sharing_sources`); only those whose
producer the config does not name are refused. Models that cache compressed latents (multi-head latent attention,
`caches_latents`) are handed their gathered history instead of blocks, since their attention reads K/V expanded
from it.
"""

from __future__ import annotations

import torch
from transformers import PretrainedConfig

from ..errors import UnsupportedAttentionError

# The name transformers' attention registries know the paged attention by (`paged_attention.py` registers it).
ATTENTION_NAME = "paged"
# The keyword `update()` leaves its handle under (`layers/handle.py`): where the step's history lives.
PAGED_KV_KWARG = "paged_kv"

# Keywords the paged attention receives and honours, each with the reason it is safe.
HONOURED: dict[str, str] = {
    PAGED_KV_KWARG: "the handle `update()` leaves: where the step's history lives",
    "softcap": "logit soft-capping (Gemma-2), applied by the torch path and the kernels",
    "sliding_window": "the layer's window: its sliding group stores exactly that window and both read paths mask by it",
    "s_aux": "learned attention-sink logits, one per query head (gpt-oss, Granite-MoE-SWA): the torch path and the "
    "kernels add them to every softmax's denominator, and eviction's attention mass too (see `sink_logits`)",
    "position_ids": "positions are already applied to query and key (RoPE); read only to count left padding",
    "use_cache": "tells the model to keep a cache; no attention math",
    "output_attentions": "weights are not returned (None, as with SDPA); outputs are unchanged",
    "output_hidden_states": "a flag for the model's outputs; no attention math",
    "output_router_logits": "a flag for a mixture-of-experts model's outputs; no attention math",
    "return_dict": "a flag for the model's outputs; no attention math",
    "num_items_in_batch": "normalises the training loss; no attention math",
    "deterministic": "a flash-attention kernel setting; no attention math",
}

# Keywords that change the attention in a way the paged attention does not implement, with what they do.
REFUSED: dict[str, str] = {
    "sinks": "attention-sink logits under another name than `s_aux` (the one form the paged attention reads)",
    "position_bias": "an additive attention bias (T5-style relative positions)",
    "indices": "a sparse selection of the keys each query attends to",
    "block_indices": "a sparse selection of the key blocks each query attends to",
    "is_causal": "is_causal=False: bidirectional attention (the paged attention is causal)",
    "cu_seq_lens_q": "packed-sequence boundaries: the paged attention would attend across the packed sequences",
    "cu_seq_lens_k": "packed-sequence boundaries: the paged attention would attend across the packed sequences",
    "max_length_q": "packed-sequence lengths: the paged attention would attend across the packed sequences",
    "max_length_k": "packed-sequence lengths: the paged attention would attend across the packed sequences",
    "seq_idx": "packed-sequence indices: the paged attention would attend across the packed sequences",
}

# Values of a refused keyword that ask for nothing the paged attention lacks.
_HARMLESS = {"is_causal": (True,)}

REMEDY = (
    'Load the model with attn_implementation="sdpa" (or "eager" where it has no SDPA support): a PagedCache then '
    "hands the attention the gathered K/V (the gather path), which is exact."
)


def check_attention_kwargs(model: str, kwargs: dict, dropout: float = 0.0) -> None:
    """Raise `UnsupportedAttentionError` for the first keyword (or a dropout) the paged attention cannot honour.

    A keyword outside both lists is refused too when it carries a value: it exists to change something."""
    if dropout:
        refuse(model, f"dropout={dropout}", "attention dropout (training mode); the paged attention has none")
    for name, value in kwargs.items():
        if name in HONOURED or value is None or any(value is harmless for harmless in _HARMLESS.get(name, ())):
            continue
        refuse(model, f"`{name}`", REFUSED.get(name, "a keyword the paged attention does not know"))


def caches_latents(config: PretrainedConfig) -> bool:
    """Whether the model caches compressed latents rather than the K/V its attention reads (multi-head latent
    attention: DeepSeek-V2/V3, Kimi, GLM-4-MoE-Lite, Mistral-4, ...). Such a model passes `update()` a single-head
    latent (`kv_lora_rank` wide) and its positional key, and expands both into per-head keys and values after
    `update()`: blocks of latents are no K/V the paged attention could read, so the cache gathers the history and
    the attention uses the K/V it is given. `kv_lora_rank` is what every such config names the latent's width; a
    heterogeneous config names it per layer (and gathering is exact for its other layers too)."""
    return _latent_rank(config) is not None


def latent_key_shape(config: PretrainedConfig) -> tuple[int, int] | None:
    """(heads, head dim) of the keys a model that caches latents passes `update()` — one head, its latent (the
    values are its positional key) — or None for a model that passes its attention's K/V."""
    rank = _latent_rank(config)
    return None if rank is None else (1, rank)


def _latent_rank(config: PretrainedConfig) -> int | None:
    """The latent width `kv_lora_rank`, read from each layer's config of a heterogeneous config (reading a per-layer
    attribute globally raises there), or None."""
    layers = config.per_layer_config if getattr(config, "is_heterogeneous", False) else [config]
    ranks = {rank for layer in layers if (rank := getattr(layer, "kv_lora_rank", None))}
    return max(ranks) if ranks else None


def kv_sharing_sources(config: PretrainedConfig) -> dict[int, int]:
    """`{consumer: producer}` of a model whose layers reuse an earlier layer's K/V (`kv_sharing_modes` "reuse", as
    in Gemma-3n): the producer is the last earlier "store" layer of the consumer's layer type, whose `update()`
    result the model hands to the consumer's attention. A consumer without one is left out (and refused above)."""
    modes, types = getattr(config, "kv_sharing_modes", None), getattr(config, "layer_types", None)
    if not modes or types is None:
        return {}
    sources, last_store = {}, {}
    for index, mode in enumerate(modes):
        if mode == "reuse" and types[index] in last_store:
            sources[index] = last_store[types[index]]
        elif mode == "store":
            last_store[types[index]] = index
    return sources


def sink_logits(model: str, kwargs: dict, heads: int) -> torch.Tensor | None:
    """The learned sink logits `s_aux` the model passes (one per query head), or None; refused in another shape,
    which would mean a sink the paged attention does not know how to apply."""
    sinks = kwargs.get("s_aux")
    if sinks is not None and (not isinstance(sinks, torch.Tensor) or tuple(sinks.shape) != (heads,)):
        shape = tuple(sinks.shape) if isinstance(sinks, torch.Tensor) else type(sinks).__name__
        refuse(model, f"`s_aux` of shape {shape}", f"sink logits other than one per query head ({heads})")
    return sinks


def refuse(model: str, feature: str, reason: str) -> None:
    raise UnsupportedAttentionError(
        f'{model} uses {feature} with the "paged" attention: {reason}, which the paged attention does not implement, '
        f"so its tokens would differ from DynamicCache. {REMEDY}"
    )


def model_name(config: PretrainedConfig) -> str:
    """The model class the config names (its first architecture), else the model family of its config class."""
    architectures = getattr(config, "architectures", None)
    return architectures[0] if architectures else f"{type(config).__name__.removesuffix('Config')} model"


def attention_is_paged(config: PretrainedConfig) -> bool:
    """Whether `config` selects the `"paged"` attention."""
    return getattr(config, "_attn_implementation", None) == ATTENTION_NAME


def check_paged_reader(config: PretrainedConfig, attention_kwargs: dict | None, evicted: bool) -> None:
    """Eviction needs the `"paged"` attention: it reads the blocks by stored index (other implementations read every
    logical position, so they would not see the gaps eviction leaves) and computes the statistics policies score by.
    Raised at the first forward, before anything changes (`evicted`: tokens were evicted already)."""
    if attention_kwargs is None:
        cause = "this model's attention calls `cache.update()` without attention kwargs, so nothing reads blocks"
        remedy = "build the cache without `eviction` for this model."
    elif not attention_is_paged(config):
        implementation = getattr(config, "_attn_implementation", None)
        cause = f"the config this cache was built from selects the {implementation!r} attention"
        remedy = (
            'call `model.set_attn_implementation("paged")` or load with `attn_implementation="paged"` (registered '
            "by `import hf_paged_cache`, and again by `register_paged_attention()`), and build the cache from that "
            "model's config."
        )
    else:
        return
    reason = "evicted tokens" if evicted else "an eviction policy"
    raise RuntimeError(f'PagedCache has {reason}, which only the "paged" attention reads, but {cause}: {remedy}')
