"""Sharing blocks: forks by reference, one copy of identical rows, cross-layer sharing, and `sharing=False`.

Exactness is against `DynamicCache` (or, for `share_with`, a `DynamicCache` that hands a layer its source
layer's K/V); the block-level invariants run on `BlockTables` with a simulated storage.
"""

from __future__ import annotations

import copy
import functools
import pickle

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from tiny_models import MODELS_BY_NAME, VOCAB
from transformers import DynamicCache

from hf_paged_cache import PagedCache
from hf_paged_cache.blocks.pool import BlockPool
from hf_paged_cache.blocks.tables import BlockTables

pytestmark = pytest.mark.usefixtures("one_thread")


@functools.lru_cache(maxsize=None)
def _model(name: str):
    model, _config = MODELS_BY_NAME[name].build()
    return model


def _ids(length: int, seed: int, batch: int = 1) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def _generate(model, ids, cache, seed: int = 0, **kwargs) -> torch.Tensor:
    torch.manual_seed(seed)
    return model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, max_new_tokens=6, **kwargs)


# ---------------------------------------------------------------------- block-level invariants
class ForkWriteFree(RuleBasedStateMachine):
    """Random forks, steps and releases of tables sharing one pool. The storage is simulated: every slot holds the
    token a table wrote there, and each table must always read back exactly the tokens it was given."""

    BLOCK = 4

    def __init__(self):
        super().__init__()
        self.pool = BlockPool(64)
        self.storage: dict[int, int] = {}  # slot -> token
        self.tables: list[tuple[BlockTables, list[list[int]]]] = []  # (tables, the tokens each row holds)
        self.next_token = 0

    def _copy(self, sources, targets):
        for source, target in zip(sources, targets):
            for offset in range(self.BLOCK):
                value = self.storage.get(source * self.BLOCK + offset)
                if value is not None:
                    self.storage[target * self.BLOCK + offset] = value

    def _step(self, tables: BlockTables, rows: list[list[int]], q_len: int, mirrors: dict[int, int]) -> None:
        batch = len(rows)
        pads = [0] * batch
        (_pool, needed, freed, _name), = tables.planner.demands(q_len, pads, mirrors)
        if needed > self.pool.num_free + freed:
            return
        plan = tables.planner.apply_step(q_len, pads, self._copy, lambda s, t: None, mirrors)
        tokens = []
        for row in range(batch):
            source = mirrors.get(row, row)
            new = tokens[source * q_len : source * q_len + q_len] if row in mirrors else list(
                range(self.next_token, self.next_token + q_len))
            self.next_token += 0 if row in mirrors else q_len
            tokens.extend(new)
            rows[row].extend(new)
        written = plan.write_tokens.tolist() if plan.write_tokens is not None else range(batch * q_len)
        for slot, token in zip(plan.write_slots.tolist(), written):
            self.storage[slot] = tokens[token]

    @rule(batch=st.integers(1, 3), q_len=st.integers(1, 9), mirror=st.booleans())
    def new_tables(self, batch, q_len, mirror):
        if len(self.tables) >= 5:
            return
        tables = BlockTables("t", self.pool, self.BLOCK)
        rows = [[] for _ in range(batch)]
        self._step(tables, rows, q_len, {row: 0 for row in range(1, batch)} if mirror else {})
        if tables.length:
            self.tables.append((tables, rows))

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def fork(self, data):
        tables, rows = data.draw(st.sampled_from(self.tables))
        self.tables.append((tables.fork(), [list(row) for row in rows]))

    @precondition(lambda self: self.tables)
    @rule(data=st.data(), q_len=st.integers(1, 6), mirror=st.booleans())
    def step(self, data, q_len, mirror):
        tables, rows = data.draw(st.sampled_from(self.tables))
        candidates = tables.planner.mirror_candidates([0] * len(rows))
        mirrors = {row: first for row, first in enumerate(candidates) if first != row} if mirror else {}
        self._step(tables, rows, q_len, mirrors)

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def release(self, data):
        index = data.draw(st.integers(0, len(self.tables) - 1))
        self.tables.pop(index)[0].release()

    @invariant()
    def references_match_tables(self):
        expected = [0] * (self.pool.num_blocks + 1)
        for tables, _rows in self.tables:
            for row in tables.rows:
                for block in row.blocks.ids:
                    expected[block] += 1
        assert [self.pool.ref_count(block) for block in range(1, self.pool.num_blocks + 1)] == expected[1:]
        assert self.pool.num_used + self.pool.num_free == self.pool.num_blocks

    @invariant()
    def every_table_reads_its_own_tokens(self):
        for tables, rows in self.tables:
            for index, tokens in enumerate(rows):
                slots = tables.rows[index].blocks.slots(0, tables.stored_tokens(index), tables.block_size).tolist()
                assert [self.storage.get(slot) for slot in slots] == tokens


TestForkWriteFree = ForkWriteFree.TestCase
TestForkWriteFree.settings = settings(max_examples=60, stateful_step_count=25, deadline=None)


# ---------------------------------------------------------------------- forks
@pytest.mark.parametrize("options", [{}, {"quant": "int8", "residual_length": 4}], ids=["plain", "int8"])
def test_forks_diverge_without_changing_their_parent(options):
    """One context, several questions: each fork answers as a fresh cache over context + question would."""
    model = _model("llama_gqa")
    model.set_attn_implementation("sdpa")
    context = _ids(18, seed=1)
    cache = PagedCache(model.config, block_size=4, **options)
    with torch.no_grad():
        model(input_ids=context, cache=cache)
    used = cache.metrics().blocks_used
    answers, forks = [], []
    for seed in (2, 3, 4):
        ids = torch.cat([context, _ids(5, seed)], dim=1)
        forks.append(cache.fork())
        assert forks[-1].get_seq_length() == cache.get_seq_length()
        answers.append(_generate(model, ids, forks[-1]))
        reference = PagedCache(model.config, block_size=4, **options) if options else DynamicCache()
        assert torch.equal(answers[-1], _generate(model, ids, reference))
    assert cache.metrics().forks == 4 and cache.metrics().shared_blocks > 0
    if not options:  # the context's full blocks are stored once: each fork added only its own blocks
        assert cache.metrics().blocks_used <= used + 3 * 3
    forks.clear()  # forks that go away return their blocks
    assert cache.metrics().forks == 1 and cache.metrics().blocks_used == used
    again = _generate(model, torch.cat([context, _ids(5, 2)], dim=1), cache)  # the parent itself is intact
    assert torch.equal(again, answers[0])


def test_deepcopy_is_a_fork_and_pickle_an_independent_copy():
    model = _model("llama_gqa")
    model.set_attn_implementation("sdpa")
    cache = PagedCache(model.config, block_size=4)
    with torch.no_grad():
        model(input_ids=_ids(10, seed=1), cache=cache)
    forked = copy.deepcopy(cache)
    assert forked.groups["full_attention"].pool is cache.groups["full_attention"].pool
    assert cache.metrics().forks == 2
    unpickled = pickle.loads(pickle.dumps(forked))
    pool = unpickled.groups["full_attention"].pool
    assert pool is not cache.groups["full_attention"].pool and unpickled.metrics().forks == 1
    # The copy's pool holds only the copy's references, not those of the family it was pickled from.
    assert [pool.ref_count(block) for block in unpickled.groups["full_attention"].rows[0].blocks.ids] == [1, 1, 1]


def test_fork_needs_a_step_boundary_and_shares_no_pool_that_does_not_exist_yet():
    model = _model("llama_gqa")
    model.set_attn_implementation("sdpa")
    cache = PagedCache(model.config, block_size=4, max_memory="1MiB")
    fork = cache.fork()  # before the first step: the max_memory pools are created per cache
    for each in (cache, fork):
        with torch.no_grad():
            model(input_ids=_ids(6, seed=1), cache=each)
    assert fork.groups["full_attention"].pool is not cache.groups["full_attention"].pool
    assert fork.layers[0].storage is not cache.layers[0].storage
    cache.layers[0].seq_len -= 1  # as if a forward were interrupted after the first layer
    with pytest.raises(RuntimeError, match="middle of a forward step"):
        cache.fork()


# ---------------------------------------------------------------------- identical rows
@pytest.mark.parametrize("name", ["llama_gqa", "mistral_sliding", "qwen2_sliding"])
@pytest.mark.parametrize("attention", ["sdpa", "paged"])
def test_identical_rows_share_their_blocks_and_stay_exact(name, attention):
    model = _model(name)
    model.set_attn_implementation(attention)
    ids = _ids(13, seed=5)
    for kwargs in ({"num_return_sequences": 4, "do_sample": True}, {"num_beams": 3, "do_sample": False}):
        expected = _generate(model, ids, DynamicCache(), **kwargs)
        shared = PagedCache(model.config, block_size=4)
        assert torch.equal(_generate(model, ids, shared, **kwargs), expected)
        unshared = PagedCache(model.config, block_size=4, sharing=False)
        assert torch.equal(_generate(model, ids, unshared, **kwargs), expected)
        assert shared.metrics().blocks_used < unshared.metrics().blocks_used
        assert unshared.metrics().shared_blocks == 0


def test_identical_rows_are_stored_once_already_at_prefill_and_near_identical_ones_never():
    model = _model("llama_gqa")
    model.set_attn_implementation("sdpa")
    row = _ids(16, seed=6)
    near = row.clone()
    near[0, -1] = (near[0, -1] + 1) % VOCAB  # differs in its last token only
    batch = torch.cat([row, row, near, row], dim=0)
    cache = PagedCache(model.config, block_size=4)
    with torch.no_grad():
        logits = model(input_ids=batch, cache=cache).logits
        expected = model(input_ids=batch, cache=DynamicCache()).logits
    assert torch.equal(logits, expected)
    tables = cache.groups["full_attention"].tables
    assert tables[0] == tables[1] == tables[3]  # one copy of the identical rows, from the prefill on
    assert not set(tables[2]) & set(tables[0])  # the near-identical row shares no block
    assert cache.metrics().blocks_used == 8


def test_a_row_that_differs_only_in_a_later_layer_gets_its_own_blocks():
    """Mirrors are chosen on the first layer's K/V; every layer checks its own before writing."""
    model = _model("llama_gqa")
    cache, reference = PagedCache(model.config, block_size=4), DynamicCache()
    keys = torch.randn(1, 2, 6, 16).expand(3, -1, -1, -1).clone()
    values = torch.randn(1, 2, 6, 16).expand(3, -1, -1, -1).clone()
    later_keys = keys.clone()
    later_keys[2, :, 4] += 1.0  # row 2 differs from row 0 in layer 1 only
    for layer, k in ((0, keys), (1, later_keys)):
        got = cache.update(k, values, layer)
        want = reference.update(k, values, layer)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    tables = cache.groups["full_attention"].tables
    assert tables[1] == tables[0] and not set(tables[2]) & set(tables[0])
    step = torch.randn(3, 2, 1, 16)
    for layer in (0, 1):  # the next step reads every row's own history in both layers
        got = cache.update(step, step, layer)
        want = reference.update(step, step, layer)
        assert all(torch.equal(a, b) for a, b in zip(got, want))


# ---------------------------------------------------------------------- cross-layer sharing
class _SharedDynamicCache(DynamicCache):
    """The reference for `share_with`: layer `reader` gets layer `source`'s K/V and stores nothing."""

    def __init__(self, config, reader: int, source: int):
        super().__init__(config=config)
        self.reader, self.source = reader, source

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if layer_idx == self.reader:
            return self.layers[self.source].keys, self.layers[self.source].values
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


@pytest.mark.parametrize("attention", ["sdpa", "paged"])
@pytest.mark.parametrize("name", ["llama_gqa", "deepseek_v3"])  # deepseek_v3: the reader is handed the latents
def test_share_with_reads_the_source_layer_and_stores_nothing(name, attention):
    model = _model(name)
    model.set_attn_implementation(attention)
    ids = _ids(11, seed=7)
    cache = PagedCache(model.config, block_size=4, share_with={1: 0})
    expected = _generate(model, ids, _SharedDynamicCache(model.config, 1, 0))
    assert torch.equal(_generate(model, ids, cache), expected)
    own = PagedCache(model.config, block_size=4)
    _generate(model, ids, own)
    assert cache.metrics().used_bytes * 2 == own.metrics().used_bytes
    off = PagedCache(model.config, block_size=4, share_with={1: 0}, sharing=False)
    assert torch.equal(_generate(model, ids, off), _generate(model, ids, DynamicCache()))


def test_share_with_errors_name_the_problem():
    model = _model("llama_gqa")
    with pytest.raises(ValueError, match="source earlier"):
        PagedCache(model.config, share_with={0: 1})
    with pytest.raises(ValueError, match="has 2 layers"):
        PagedCache(model.config, share_with={5: 0})
    with pytest.raises(ValueError, match="both a reader"):
        PagedCache(model.config, share_with={1: 0, 2: 1})
    gemma = _model("gemma2")  # alternating sliding / full layers
    with pytest.raises(ValueError, match="same kind and window"):
        PagedCache(gemma.config, share_with={1: 0})


def test_sharing_off_copies_forks():
    model = _model("llama_gqa")
    model.set_attn_implementation("sdpa")
    cache = PagedCache(model.config, block_size=4, sharing=False)
    with torch.no_grad():
        model(input_ids=_ids(9, seed=8), cache=cache)
    fork = cache.fork()
    assert fork.groups["full_attention"].pool is not cache.groups["full_attention"].pool
    assert cache.metrics().forks == 1 and cache.metrics().shared_blocks == 0
