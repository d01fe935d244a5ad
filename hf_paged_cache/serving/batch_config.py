"""`BatchConfig`: the batch generator's knobs, with its strategies given by name or as instances; and the split of
the generator's keyword options into batching, generation and cache options.

A strategy string maps through a name table to its class (`PREEMPTIONS`, `VICTIM_POLICIES`, `SCHEDULERS`);
the knobs given as fields (`swap_blocks`, `swap_compression`, `swap_copies`; `decay`, `size_weight`) go to the
`Swap` / `WeightedVictims` the name makes, and an instance brings its own.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings
from dataclasses import dataclass

from transformers import GenerationConfig, PreTrainedModel

from ..config import PagedCacheConfig, parse_bytes
from ..distributed import tensor_parallel_size
from ..accounting import blocks_in_budget
from ..sequence_state import sequence_state
from ..memory.copy_stream import COPY_MODES
from .preemption import Auto, LRUVictims, Preemption, Recompute, Swap, VictimPolicy, WeightedVictims, check_weights
from .scheduler import FIFO, DecodeFirst, Scheduler
from .settings import FIELDS, check_generation_config

PREEMPTIONS: dict[str, type[Preemption]] = {"auto": Auto, "swap": Swap, "recompute": Recompute}
VICTIM_POLICIES: dict[str, type[VictimPolicy]] = {"lru": LRUVictims, "weighted": WeightedVictims}
SCHEDULERS: dict[str, type[Scheduler]] = {"decode_first": DecodeFirst, "fifo": FIFO}
_CACHE_FIELDS = frozenset(f.name for f in dataclasses.fields(PagedCacheConfig))
_GENERATION_FIELDS = FIELDS - _CACHE_FIELDS


_SWAP_KNOBS = ("swap_blocks", "swap_compression", "swap_copies")


@dataclass(frozen=True)
class BatchConfig:
    """The batching knobs (the cache's own options are `PagedCacheConfig`'s).

    Args:
        max_batch_tokens: tokens one forward computes at most (prompt chunks and decode tokens together).
        max_num_seqs: requests running at once at most (the seeds' `--max-num-seqs`); a hybrid model's state pool
            holds this many slots of recurrent state, allocated up front (`state_pool.py`).
        prefix_caching: reuse full blocks of earlier requests with the same leading tokens (full-precision
            caches without eviction; ignored otherwise, see `PrefixCache.supports`). A hybrid model's hits also
            restore the recurrent state kept after the prefix (`checkpoint_memory`).
        checkpoint_memory: bytes (an int or "64MiB") for a hybrid model's state checkpoints, the recurrent / conv
            state kept after cached prefixes (`state_checkpoints.py`), least recently used dropped first; None: as
            many bytes as the state pool (one checkpoint per slot); 0: none (no prefix hits for such a model).
            Counted in `max_memory`.
        progress: show a progress bar of finished requests.
        preemption: what happens to a preempted request (a `Preemption`, or its name): `"swap"` (`Swap`: its
            blocks go to host memory and come back before it runs again; recompute when the host pool is full),
            `"recompute"` (`Recompute`: its blocks are dropped and it is queued again with its generated tokens
            as part of its prompt), or `"auto"` (`Auto`): the cheaper of the two by an estimate.
        victim_policy: which running request is preempted first (a `VictimPolicy`, or its name): `"lru"`
            (`LRUVictims`: least recently scheduled; ties: the latest admitted) or `"weighted"`
            (`WeightedVictims(decay, size_weight)`, the seeds' score).
        swap_threshold: preempt before the pools run dry, as soon as more than this share of a pool is in use
            (and admit or swap in only while it stays below); None: preempt only when a request cannot get its
            next block.
        swap_blocks: host blocks per device pool (None: as many as the device pool has). The `swap_*` knobs below
            (but `swap_threshold`) go to the `Swap` / `Auto` that `"swap"` / `"auto"` make.
        swap_compression: a `quant` format ("fp8", "int4", ...) for host copies of full-precision blocks: fewer
            host bytes and less copy traffic, at a small quality cost (they come back close, not bit-exact).
        swap_copies: when swap copies run (`copy_stream.py`): `"auto"` (asynchronous on CUDA, synchronous
            otherwise), `"sync"`, `"async"` (a CUDA side stream: copies overlap the forwards that do not need
            them), or `"deferred"` (each copy waits until a step needs it: a check that outputs do not depend on
            when copies land).
        decay, size_weight: the `"weighted"` victim policy's time decay per step and size weight.
        defragment_threshold: defragment the pools (`memory/defragment.py`) after a step that leaves more than this
            share of the ids below a pool's highest block in use free; None: only when `defragment()` is called.
        compact_threshold: deprecated, `defragment_threshold`.
        scheduler: the order running requests get a step's tokens in (a `Scheduler`, or its name):
            `"decode_first"` (`DecodeFirst`, decode tokens first, by victim priority) or `"fifo"` (`FIFO`).
        compile: run the packed forwards with the decoder layers' feed-forward blocks and norms compiled
            (`torch.compile`, dynamic shapes; `cpu_runtime/compiled.py`): faster steps after a compile on the first ones. Fused
            kernels round differently in the last bits, so a greedy token may, rarely, differ from eager `generate`.
        onednn: run the packed forwards' `nn.Linear` layers whose weights are on the CPU through oneDNN's matrix
            product (`cpu_runtime/onednn.py`) rather than torch's BLAS, which is slower on some CPUs, Llama-style gated-SiLU
            MLPs as two fused products, and decoder layers of Llama's code as one fused forward (`cpu_runtime/fused_layers.py`,
            not with `compile`); no effect elsewhere. Its kernels round differently in the last bits, so a
            greedy token may, rarely, differ from eager `generate`.
        prepack_weights: with `onednn`, keep those layers' weights in oneDNN's own layout, packed once when the
            generator is built, instead of reordered at every product: faster steps (most of all decode steps), for
            a second copy of those weights in memory (`BatchMetrics.packed_weight_bytes`). A weight
            replaced or changed in place by a torch op is packed again; a change through `.data` is not seen (build
            a new generator after one).
        keep_host_memory: keep the memory the forwards free inside the process instead of handing it back to the
            kernel and faulting it in again at the next step (`memory/host_heap.py`: glibc's malloc thresholds, set
            when the generator is built). Process-wide and for the rest of the process; glibc only (refused
            elsewhere). The process's heap then stays at its peak.
    """

    max_batch_tokens: int = 512
    max_num_seqs: int = 32
    prefix_caching: bool = True
    checkpoint_memory: int | str | None = None
    progress: bool = False
    preemption: str | Preemption = "auto"
    victim_policy: str | VictimPolicy = "lru"
    swap_threshold: float | None = None
    swap_blocks: int | None = None
    swap_compression: str | None = None
    swap_copies: str = "auto"
    decay: float = 0.9
    size_weight: float = 1.0
    defragment_threshold: float | None = None
    compact_threshold: float | None = None  # deprecated: `defragment_threshold`
    scheduler: str | Scheduler = "decode_first"
    compile: bool = False
    onednn: bool = True
    prepack_weights: bool = False
    keep_host_memory: bool = False

    def __post_init__(self) -> None:
        for name in ("max_batch_tokens", "max_num_seqs"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}` must be a positive int, got {value!r}")
        for name in ("prefix_caching", "progress", "compile", "onednn", "prepack_weights", "keep_host_memory"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"`{name}` must be a bool, got {getattr(self, name)!r}")
        if isinstance(self.checkpoint_memory, bool) or self.checkpoint_memory not in (None, 0):
            parse_bytes(self.checkpoint_memory, "checkpoint_memory")
        if self.prepack_weights and not self.onednn:
            raise ValueError("`prepack_weights=True` packs the weights for oneDNN's products: it needs `onednn=True`")
        for name, table, base in (("preemption", PREEMPTIONS, Preemption), ("victim_policy", VICTIM_POLICIES,
                                  VictimPolicy), ("scheduler", SCHEDULERS, Scheduler)):  # fmt: skip
            value = getattr(self, name)
            if not isinstance(value, base) and (not isinstance(value, str) or value not in table):
                raise ValueError(
                    f"`{name}` must be one of {tuple(table)} or a `{base.__name__}` instance, got {value!r}"
                )
        if self.swap_copies not in COPY_MODES:
            raise ValueError(f"`swap_copies` must be one of {COPY_MODES}, got {self.swap_copies!r}")
        if self.compact_threshold is not None:
            warnings.warn("`compact_threshold` is `defragment_threshold`", FutureWarning, stacklevel=3)
            if self.defragment_threshold is not None:
                raise ValueError("give `defragment_threshold` alone (`compact_threshold` is its deprecated name)")
            object.__setattr__(self, "defragment_threshold", self.compact_threshold)
        for name in ("swap_threshold", "defragment_threshold"):
            value = getattr(self, name)
            share = not isinstance(value, bool) and isinstance(value, (int, float)) and 0 < value <= 1
            if value is not None and not share:
                raise ValueError(f"`{name}` must be in (0, 1] (a share of the pool) or None, got {value!r}")
        check_weights(self.decay, self.size_weight)
        for strategy, knobs in (("preemption", _SWAP_KNOBS), ("victim_policy", ("decay", "size_weight"))):
            given = [name for name in knobs if getattr(self, name) != _DEFAULTS[name]]
            if given and not isinstance(getattr(self, strategy), str):
                raise ValueError(
                    f"{given} are knobs of the `{strategy}` named by a string; a `{strategy}` instance brings its own: "
                    f"give them to it (e.g. `Swap(compression=...)`, `WeightedVictims(decay=...)`)"
                )

    def checkpoint_bytes(self, state_pool_bytes: int) -> int:
        """Bytes for state checkpoints (`checkpoint_memory`; None: as many as the state pool's)."""
        if self.checkpoint_memory is None:
            return state_pool_bytes
        return 0 if self.checkpoint_memory == 0 else parse_bytes(self.checkpoint_memory, "checkpoint_memory")

    def make_preemption(self) -> Preemption:
        if isinstance(self.preemption, Preemption):
            return self.preemption
        strategy = PREEMPTIONS[self.preemption]
        if issubclass(strategy, Swap):
            return strategy(blocks=self.swap_blocks, compression=self.swap_compression, copies=self.swap_copies)
        return strategy()

    def make_victims(self) -> VictimPolicy:
        if isinstance(self.victim_policy, VictimPolicy):
            return self.victim_policy
        if self.victim_policy == "weighted":
            return WeightedVictims(self.decay, self.size_weight)
        return VICTIM_POLICIES[self.victim_policy]()

    def make_scheduler(self) -> Scheduler:
        return self.scheduler if isinstance(self.scheduler, Scheduler) else SCHEDULERS[self.scheduler]()


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(BatchConfig)}


def split_options(model: PreTrainedModel, generation_config: GenerationConfig | None,
                  options: dict) -> tuple[BatchConfig, GenerationConfig, dict]:  # fmt: skip
    """The batching knobs, the generation config (generation settings given as options override its own) and the
    remaining options, which are the cache's; every name and value checked, nothing changed."""
    batch_fields = {f.name for f in dataclasses.fields(BatchConfig)}
    unknown = sorted(set(options) - batch_fields - _GENERATION_FIELDS - _CACHE_FIELDS)
    if unknown:
        raise ValueError(
            f"Unknown option(s) {unknown}. Batching options: {sorted(batch_fields)}; cache options: "
            f"{sorted(_CACHE_FIELDS)}; generation options: any `GenerationConfig` field"
        )
    if generation_config is not None and not isinstance(generation_config, GenerationConfig):
        raise ValueError(
            f"`generation_config` must be a transformers `GenerationConfig`, got "
            f"{type(generation_config).__name__}: pass `GenerationConfig(**settings)`, or the settings as "
            "keyword options"
        )
    config = BatchConfig(**{k: v for k, v in options.items() if k in batch_fields})
    generation = copy.deepcopy(generation_config or model.generation_config)
    for name in [k for k in options if k in _GENERATION_FIELDS]:
        setattr(generation, name, options[name])
    check_generation_config(generation, "the generation config")
    return config, generation, {k: v for k, v in options.items() if k in _CACHE_FIELDS}


def pools_up_front(options: PagedCacheConfig, model: PreTrainedModel, config: BatchConfig) -> PagedCacheConfig:
    """A `max_memory` budget as `num_blocks`: a cache sizes `max_memory` pools at its first step, which would give
    every request pools of its own; the requests must share the template's from the start. A hybrid model's state
    pool (`max_num_seqs` slots of recurrent state, `state_pool.py`) and, with prefix caching, its state checkpoints
    (`checkpoint_memory`) are served from the same budget, first."""
    if options.max_memory is None:
        return options
    state = sequence_state(model.config, model.dtype, type(model))
    slots = config.max_num_seqs * state.nbytes
    kept = config.prefix_caching and state.checkpointable(model.config.model_type)  # `PrefixCache.supports`
    checkpoints = config.checkpoint_bytes(slots) if kept else 0
    if slots and slots + checkpoints >= options.max_memory:
        raise ValueError(
            f"`max_memory`={options.max_memory} bytes cannot hold the recurrent state of `max_num_seqs`="
            f"{config.max_num_seqs} requests ({slots} bytes) and its checkpoints ({checkpoints} bytes, "
            "`checkpoint_memory`), besides any block: raise `max_memory`, or lower `max_num_seqs` or "
            "`checkpoint_memory`"
        )
    num_blocks = blocks_in_budget(model.config, options.max_memory - slots - checkpoints, options.block_size,
                                  options.dtype or model.dtype, tensor_parallel_size(model.config))  # fmt: skip
    return dataclasses.replace(options, max_memory=None, num_blocks=num_blocks)
