"""A batch-generator request's state between steps, and the result it hands back.

A request's cache holds `fed` of its `tokens`; everything the scheduler, the victim policies and the
preemption strategies decide is read from these fields, so they live on the request, not in the generator.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..cache import PagedCache
from .request_memory import RequestMemory
from .settings import RequestSettings


@dataclass
class GenerationOutput:
    """One request's result: `generated_tokens` (ids), why it stopped ("eos", "stop_string", "length", "cancelled",
    "error"),
    the error message if any, and how many prompt tokens came from the prefix cache."""

    request_id: int
    prompt_ids: list[int]
    generated_tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    prefix_hit_tokens: int = 0


@dataclass
class Request:
    """A queued, running or preempted request: its output so far, its settings and its memory."""

    output: GenerationOutput
    settings: RequestSettings
    memory: RequestMemory | None = None  # its cache and state slot (None while queued without a prefix hit)
    fed: int = 0  # tokens in its cache
    keys: list[bytes] = field(default_factory=list)  # prefix-cache keys of its full blocks
    marks: list[int] = field(default_factory=list)  # where it keeps its recurrent state next (`checkpoint_marks`)
    last_step: int = -1  # the step it was last scheduled in
    hotness: float = 0.0  # the weighted victim policy's access score, as of `last_step`
    peak: int = 0  # most tokens its cache ever held (tokens fed again below it are recomputed)
    admitted: bool = False  # admitted once (later admissions follow a preemption or a rolled-back step)
    isolated: bool = False  # runs in a forward of its own: a forward it shared with others failed

    @property
    def request_id(self) -> int:
        return self.output.request_id

    @property
    def cache(self) -> PagedCache | None:
        """Its cache, which its memory holds."""
        return None if self.memory is None else self.memory.cache

    @property
    def tokens(self) -> list[int]:
        """What the model has seen or will see: the prompt, then the generated tokens (after a recompute
        preemption all of them are fed again, as a prompt)."""
        return self.output.prompt_ids + self.output.generated_tokens

    @property
    def pending(self) -> int:
        """Tokens to feed before the next sample: a prompt's remaining tokens, or the last generated one."""
        return len(self.output.prompt_ids) + len(self.output.generated_tokens) - self.fed

    def samples_after(self, q: int) -> bool:
        """Whether a step that feeds `q` of its pending tokens feeds the last one, so a token is sampled."""
        return self.pending <= q

    def next_token(self, q: int, logits: torch.Tensor) -> int | Exception | None:
        """The next token once a step feeds `q` of its pending tokens (None before the last one), or the error its
        sampling raised (it fails alone)."""
        if not self.samples_after(q):
            return None
        try:
            return self.settings.next_token(logits, self.tokens)
        except Exception as error:  # noqa: BLE001 -- recorded on the request's output
            return error
