"""Key novelty: how unlike any other stored token of its KV head a token's key is. `KeyNovelty` ranks by it
alone; `ProtectNovel` lets any policy take the most novel tokens first, so that a one-off fact in repetitive
text survives a compression made before the question asking for it is read."""

from __future__ import annotations

import torch
import torch.nn.functional as F

ROTARY_PAIRINGS = ("half", "interleaved", "none")
NOVELTY_CHUNK = 512  # keys compared at a time by `key_novelty` (bounds the `[heads, chunk, n]` similarities)


def check_novelty_options(name: str, fraction: object, rotary: object, fraction_name: str = "protect_novel") -> None:
    """Raise unless `fraction` is a share of the budget in [0, 1) and `rotary` a known pairing."""
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0.0 <= fraction < 1.0:
        raise ValueError(f"{name}: `{fraction_name}` is a fraction of the budget in [0, 1), got {fraction!r}")
    if rotary not in ROTARY_PAIRINGS:
        raise ValueError(f"{name}: `rotary` must be one of {ROTARY_PAIRINGS}, got {rotary!r}")


def key_novelty(keys: torch.Tensor, rotary: str) -> torch.Tensor:
    """Per KV head and token, minus the largest cosine similarity of its key to any other token's: `[kv_heads, n]`
    from `keys` `[kv_heads, n, head_dim]` (higher = more novel). Keys are stored after the rotary embedding,
    which turns a repeated word's key by an angle that depends on where it stands; the magnitude of each
    rotated channel pair does not change, so tokens are compared by those magnitudes (`rotary_magnitudes`).
    O(n^2) per head, `NOVELTY_CHUNK` keys at a time."""
    signature = F.normalize(rotary_magnitudes(keys, rotary), dim=-1)  # [kv_heads, n, m]
    heads, count, _ = signature.shape
    scores = torch.empty(heads, count)
    for start in range(0, count, NOVELTY_CHUNK):
        stop = min(start + NOVELTY_CHUNK, count)
        similarity = signature[:, start:stop] @ signature.transpose(1, 2)  # [kv_heads, chunk, n]
        rows = torch.arange(stop - start)
        similarity[:, rows, rows + start] = float("-inf")  # a token is not its own copy
        scores[:, start:stop] = -similarity.amax(dim=-1)
    return scores


def rotary_magnitudes(keys: torch.Tensor, rotary: str) -> torch.Tensor:
    """`keys` `[..., head_dim]` as the magnitudes of their rotary channel pairs `[..., head_dim / 2]` (raw keys
    for `rotary="none"`): the same for a key wherever the rotary embedding placed it."""
    if rotary == "none":
        return keys
    if rotary == "half":
        first, second = keys.chunk(2, dim=-1)
    else:
        first, second = keys[..., 0::2], keys[..., 1::2]
    return torch.sqrt(first.square() + second.square())
