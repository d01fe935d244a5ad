"""The runner: one packed forward of many sequences in a single row (`packed_logits`), each with its own `PagedCache`
behind one `PackedCache`.

The batch generator runs an unmodified HF model (`packed_logits`) on `input_ids` of shape `[1, tokens]` that
concatenate prompt chunks and decode tokens of many requests (no padding stored or computed), with each token's own
position in `position_ids`. The model calls `update()` once per layer with the packed K/V; this cache
hands each request's slice to that request's `PagedCache` (forks of one template, so they share pools)
and leaves a `PackedPagedKV` for the `"paged"` attention, which attends each request over its own blocks. For a
model that caches latents (multi-head latent attention) it returns the requests' gathered histories concatenated,
which the model expands into K/V, and the attention attends each request over its own span of them. Layers whose
state runs along a sequence (linear attention, Mamba, convolutions) run once per request instead (`recurrent.py`).
"""

from __future__ import annotations

import contextlib

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..cache import PagedCache
from ..attention.contract import PAGED_KV_KWARG
from ..errors import UnsupportedModelError
from ..layers.handle import PackedPagedKV, PagedKV
from ..attention.paged_states import paged_only
from ..cpu_runtime.compiled import CompiledModules
from ..cpu_runtime.fused_layers import FusedDecoderLayers
from ..cpu_runtime.onednn import OneDnnLinears
from .recurrent import PerRequestLayers, StateCuts


class _PackedLayer(CacheLayerMixin):
    """What transformers' mask code asks of a layer. Masks are made per request by the attention itself, so
    the model-made mask only needs to be small: it covers the packed tokens alone."""

    is_compileable = False

    def __init__(self, is_sliding: bool):
        super().__init__()
        self.is_sliding = is_sliding

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Nothing to allocate: the requests' caches store the K/V."""

    def update(self, key_states, value_states, *args, **kwargs):
        raise RuntimeError("A packed forward's layers are updated through PackedCache.update")

    def get_seq_length(self) -> int:
        return 0

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return query_length, 0

    def get_max_length(self) -> int:
        return -1


class PackedCache(Cache):
    """The caches of one packed forward: `caches[i]` receives tokens `[spans[i][0], spans[i][1])`. `positions`
    (`[1, tokens]`) tell each cache its tokens' positions where the model's attention is not given them (Llama-4),
    so a request's cache knows it holds no padding."""

    def __init__(self, caches: list[PagedCache], spans: list[tuple[int, int]], sliding: list[bool],
                 positions: torch.Tensor | None = None):  # fmt: skip
        super().__init__(layers=[_PackedLayer(is_sliding) for is_sliding in sliding])
        self.caches = caches
        self.spans = spans
        self.positions = positions
        self.memo: dict = {}  # what the forward's layers share (read indices of a group's decode tokens)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        attention_kwargs = kwargs.get("kwargs")
        if attention_kwargs is None:
            raise UnsupportedModelError(
                "This model's attention calls `cache.update()` without attention kwargs, so packed sequences cannot "
                "be told apart: the batch generator needs a model that passes them (Llama, Mistral, Qwen, Gemma, ...)"
            )
        positions = attention_kwargs.get("position_ids")
        positions = self.positions if positions is None else positions
        written, parts, histories = self._write_together(key_states, value_states, layer_idx), [], []
        for index, (cache, (start, stop)) in enumerate(zip(self.caches, self.spans)):
            if index in written:
                parts.append(written[index])
                continue
            own = {} if positions is None else {"position_ids": positions[..., start:stop]}
            histories.append(cache.update(key_states[:, :, start:stop], value_states[:, :, start:stop], layer_idx,
                                          kwargs=own))  # fmt: skip
            parts.append((start, stop, own[PAGED_KV_KWARG]))
        packed = attention_kwargs[PAGED_KV_KWARG] = PackedPagedKV(parts, self.memo)
        if packed.gathered:  # a model that caches latents expands every sequence's gathered history into K/V
            return tuple(torch.cat(states, dim=2) for states in zip(*histories))
        return paged_only(key_states, packed), paged_only(value_states, packed)  # a KV-shared layer reads through it

    def _write_together(self, key_states: torch.Tensor, value_states: torch.Tensor,
                        layer_idx: int) -> dict[int, tuple[int, int, PagedKV]]:  # fmt: skip
        """A later layer of the step (an earlier one planned every cache's step): the new K/V of the sequences whose
        caches need nothing but the write (after sealing the blocks a chunk completes, `take_step`), and share the
        layer's storage with the first such, written in one copy; their handles by index. The others (planning,
        eviction, mirrors, the kernels) take their own `update`."""
        plans = [cache.planned_row(layer_idx, stop - start, key_states.device) for cache, (start, stop) in zip(self.caches, self.spans)]
        layers = [cache.layers[layer_idx] for cache in self.caches]
        plain = [index for index, plan in enumerate(plans) if plan is not None]
        together = [index for index in plain if layers[index].storage is layers[plain[0]].storage] if plain else []
        if not together:
            return {}
        written = {}
        for index in together:
            start, stop = self.spans[index]
            written[index] = (start, stop, self.caches[index].take_step(layer_idx, plans[index], key_states,
                                                                        value_states, slice(start, stop)))  # fmt: skip
        if len(together) == len(self.caches):  # every token: the states as they lie
            layers[together[0]].write_rows([plans[index] for index in together], key_states, value_states, self.memo)
        else:
            key = ("write_tokens", tuple(together))
            if key not in self.memo:  # the same for every later layer of the forward
                self.memo[key] = torch.cat([torch.arange(*self.spans[index]) for index in together]).to(key_states.device)
            tokens = self.memo[key]
            layers[together[0]].write_rows([plans[index] for index in together], key_states.index_select(2, tokens),
                                           value_states.index_select(2, tokens), self.memo)  # fmt: skip
        return written


def check_packable(template: PagedCache) -> None:
    """Refuse a model whose layers the packed forward cannot serve: it serves layers stored in blocks (full, sliding
    or chunked attention) and layers run per request."""
    for index, (layer, layer_type) in enumerate(zip(template.layers, template.layer_types)):
        kind = layer_type.packing_refusal(layer)
        if kind is not None:
            raise ValueError(
                f"Layer {index} is {kind}: the batch generator serves models whose layers are full, sliding-window "
                "or chunked attention, or recurrent; use `model.generate` with a `PagedCache` for this model"
            )


def layer_sliding(cache: PagedCache) -> list[bool]:
    """transformers' `is_sliding` of each layer of `cache` (False for a layer that holds recurrent state only)."""
    return [isinstance(layer, CacheLayerMixin) and layer.is_sliding for layer in cache.layers]


def packed_logits(model, chunks: list[tuple[PagedCache, list[int], int]], sliding: list[bool],
                  per_request: PerRequestLayers | None = None, compiled: CompiledModules | None = None,
                  onednn: OneDnnLinears | None = None,
                  fused: FusedDecoderLayers | None = None, cuts: StateCuts | None = None) -> torch.Tensor:  # fmt: skip
    """One forward of every chunk (its cache, its tokens, the position of the first) packed into one row; the
    logits of each chunk's last token, one row per chunk (`sliding`: which layers are sliding-window;
    `per_request`: the layers that run once per chunk, recurrent ones, cut inside chunks where `cuts` says;
    `compiled`: modules run compiled; `onednn`: linear layers run on oneDNN; `fused`: decoder layers run fused)."""
    tokens, positions, spans, keep = [], [], [], []
    for _cache, chunk, start in chunks:
        spans.append((len(tokens), len(tokens) + len(chunk)))
        keep.append(len(tokens) + len(chunk) - 1)
        tokens += chunk
        positions += range(start, start + len(chunk))
    ids, position_ids = torch.tensor([tokens], device=model.device), torch.tensor([positions], device=model.device)
    keep = torch.tensor(keep, device=model.device)
    caches = [chunk[0] for chunk in chunks]
    with contextlib.ExitStack() as patches:
        inside_fused = set()  # modules of the layers that run fused: nothing calls their forwards
        if fused is not None:  # first: it checks that no other forward is swapped into its layers
            inside_fused = patches.enter_context(fused.active(keep))
        if per_request is not None:
            patches.enter_context(per_request.split(caches, spans, cuts))
        if onednn is not None:
            patches.enter_context(onednn.active(skip=inside_fused))
        if compiled is not None:
            patches.enter_context(compiled.active())
        return model(input_ids=ids, position_ids=position_ids, cache=PackedCache(caches, spans, sliding, position_ids),
                     use_cache=True, logits_to_keep=keep).logits[0]  # fmt: skip
