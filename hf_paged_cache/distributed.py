"""Tensor parallelism: how many ranks share a model's KV heads, and the one collective a `PagedCache` needs.

Under transformers' tensor parallelism (`from_pretrained(path, tp_plan="auto")` under `torchrun`) each
rank's attention layers hold `num_key_value_heads / tp_size` heads. Each rank's `PagedCache` stores
just those heads (storage is sized from the K/V it receives), and block allocation is deterministic, so
every rank holds the same tables without communicating. Eviction is the one decision that depends on
the heads: a rank scores tokens from its own heads only, so the per-token scores are averaged over the
group first (`reduce_scores`), and every rank keeps the same tokens, the ones one process would keep.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from transformers import PretrainedConfig


def tensor_parallel_size(config: PretrainedConfig) -> int:
    """Ranks the model of `config` is split over by tensor parallelism (1 = none).

    transformers records a model's `DistributedConfig` (from `tp_plan=` / `distributed_config=`) on its
    config, so a cache built from `model.config` learns the group size without being told.
    """
    size = getattr(getattr(config, "distributed_config", None), "tp_size", None) or 1
    if size > 1 and not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"The model was loaded with tensor parallelism (tp_size={size}) but torch.distributed is not initialized "
            "in this process: build the PagedCache in the ranks that run the model (under torchrun)."
        )
    return size


def reduce_scores(scores: torch.Tensor, tp_size: int) -> torch.Tensor:
    """Per-token eviction scores `[n]` from a policy's `[n]` or `[kv_heads, n]`: the mean over this rank's
    heads, averaged over the `tp_size` tensor-parallel ranks (one all-reduce), identical on every rank.

    Every rank makes the same eviction calls (same rows, lengths and budgets: the tables agree), so each
    reaches this collective equally often. Scores that do not depend on heads (StreamingLLM's positions,
    seeded random) are reduced too: averaging equal values leaves them equal and keeps that count uniform.
    """
    scores = scores.float()
    if scores.dim() == 2:
        scores = scores.mean(0)
    if tp_size == 1:
        return scores
    world = dist.get_world_size()
    if world != tp_size:
        raise NotImplementedError(
            f"PagedCache eviction under tensor parallelism reduces scores over the whole world, but tp_size={tp_size} "
            f"and the world has {world} ranks (data or pipeline parallelism too): run such models without `eviction`."
        )
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    reduced = scores.to(device, copy=True)
    dist.all_reduce(reduced)
    return (reduced / tp_size).to(scores.device)
