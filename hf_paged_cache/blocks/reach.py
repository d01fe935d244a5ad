"""How far back a group's reads reach: the strategy by which a group's `BlockTables` drop leading blocks.

A sliding window reaches the last `size` positions. Chunked attention (Llama-4) reaches back only to the start of
the query's chunk, which transformers counts from each row's first real token (`chunked_overlay`), so what a row
keeps depends on its left padding; what a step reads (transformers' `kv_offset`) stays the window of the chunk
size, as transformers' sliding layer of that size gives it, which holds every row's chunk.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SlidingWindow:
    """Each query reads itself and the `size - 1` positions before it."""

    size: int

    def read_offset(self, length: int) -> int:
        """First logical position a step that starts at `length` reads, in every row."""
        return max(length - self.size + 1, 0)

    def first_read(self, length: int, pads: int | None) -> int:
        """First logical position such a step reads in a row of `pads` left pads (None: not known exactly)."""
        return self.read_offset(length)


@dataclass(frozen=True)
class Chunks(SlidingWindow):
    """Each query reads its own chunk of `size` positions up to itself, chunks starting at the row's first real
    token; a step reads nothing from before the chunk its first query falls in, which lies inside the window."""

    def first_read(self, length: int, pads: int | None) -> int:
        if pads is None:  # where chunks start is not known: keep the window, which holds every chunk
            return self.read_offset(length)
        return max(pads + (length - pads) // self.size * self.size, 0)


Reach = SlidingWindow | Chunks
