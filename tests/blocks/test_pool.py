"""Allocator invariants: a hypothesis state machine drives allocate / fork / free / grow against a model."""

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hf_paged_cache.blocks.pool import GROWTH, NULL_BLOCK, BlockPool, grown_size
from hf_paged_cache.errors import OutOfBlocksError


class BlockPoolMachine(RuleBasedStateMachine):
    """The model is a dict block -> expected reference count; the free queue's order is checked too."""

    def __init__(self):
        super().__init__()
        self.pool = BlockPool(8)
        self.refs: dict[int, int] = {}
        self.owned: list[int] = []  # one entry per reference handed out

    @rule(count=st.integers(0, 4), continue_run=st.booleans())
    def allocate(self, count, continue_run):
        after = self.owned[-1] if continue_run and self.owned else None
        continues_run = after is not None and self.pool.is_free(after + 1)
        if count > self.pool.num_free:
            with pytest.raises(ValueError):
                self.pool.allocate(count, after=after)
            return
        blocks = self.pool.allocate(count, after=after)
        assert len(set(blocks)) == count
        for block in blocks:
            assert block != NULL_BLOCK and block not in self.refs, "handed out a block that is in use"
            self.refs[block] = 1
            self.owned.append(block)
        if blocks and continues_run:
            assert blocks[0] == after + 1, "did not continue the run although the next block was free"

    @rule(counts=st.lists(st.integers(0, 3), max_size=4))
    def allocate_runs(self, counts):
        if sum(counts) > self.pool.num_free:
            with pytest.raises(ValueError):
                self.pool.allocate_runs(counts)
            return
        runs = self.pool.allocate_runs(counts)
        assert [len(run) for run in runs] == counts
        for block in (block for run in runs for block in run):
            assert block != NULL_BLOCK and block not in self.refs, "handed out a block that is in use"
            self.refs[block] = 1
            self.owned.append(block)

    @precondition(lambda self: self.owned)
    @rule(data=st.data())
    def fork(self, data):
        block = data.draw(st.sampled_from(self.owned))
        self.pool.fork([block])
        self.refs[block] += 1
        self.owned.append(block)

    @precondition(lambda self: self.owned)
    @rule(data=st.data())
    def free(self, data):
        block = data.draw(st.sampled_from(self.owned))
        self.pool.free([block])
        self.owned.remove(block)
        self.refs[block] -= 1
        if self.refs[block] == 0:
            del self.refs[block]

    @rule(block=st.integers(0, 20))
    def free_unowned_is_rejected_and_changes_nothing(self, block):
        if block in self.refs:
            return
        before = (self.pool.num_free, self.pool.free_ids(), self.pool.ref_counts())
        with pytest.raises(ValueError):
            self.pool.free([block])
        assert before == (self.pool.num_free, self.pool.free_ids(), self.pool.ref_counts())

    @rule(block=st.integers(0, 20))
    def fork_unallocated_is_rejected(self, block):
        if block not in self.refs:
            with pytest.raises(ValueError):
                self.pool.fork([block])

    @precondition(lambda self: self.pool.num_blocks < 32)
    @rule(extra=st.integers(0, 4))
    def grow(self, extra):
        before = self.pool.num_blocks
        self.pool.grow(extra)
        assert self.pool.num_blocks == before + extra

    @invariant()
    def counts_add_up(self):
        assert self.pool.num_used + self.pool.num_free == self.pool.num_blocks
        assert self.pool.num_used == len(self.refs)

    @invariant()
    def ref_counts_match(self):
        for block in range(1, self.pool.num_blocks + 1):
            assert self.pool.ref_count(block) == self.refs.get(block, 0)
            assert self.pool.is_free(block) == (block not in self.refs)

    @invariant()
    def free_queue_holds_exactly_the_free_blocks(self):
        queue = self.pool.free_ids()
        assert len(queue) <= self.pool.num_blocks, "cycle in the free queue"
        assert sorted(queue) == [b for b in range(1, self.pool.num_blocks + 1) if b not in self.refs]


TestBlockPoolMachine = BlockPoolMachine.TestCase
TestBlockPoolMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_freed_blocks_go_to_the_tail_in_order():
    pool = BlockPool(4)
    first = pool.allocate(4)
    assert first == [1, 2, 3, 4]
    pool.free([3])
    pool.free([1])
    assert pool.allocate(2) == [3, 1]


def test_allocation_continues_a_run_when_the_next_block_is_free():
    pool = BlockPool(8)
    a = pool.allocate(2)  # 1, 2
    b = pool.allocate(2)  # 3, 4
    pool.free(b)
    assert pool.allocate(2, after=a[-1]) == [3, 4]
    assert pool.allocate(1, after=a[-1]) == [5]  # 3 is taken, so the head of the queue


def test_runs_of_a_batch_are_spread_with_equal_gaps_so_each_can_grow_in_place():
    assert BlockPool(10).allocate_runs([2, 2]) == [[1, 2], [6, 7]]  # (10 - 4) // 2 = 3 free after each run
    pool = BlockPool(20)
    pool.allocate(2)  # 1, 2: the longest free stretch, 3..20, follows a block in use: a gap before the runs too
    assert pool.allocate_runs([3, 1, 2]) == [[6, 7, 8], [12], [16, 17]]  # (18 - 6) // 4 = 3
    assert pool.allocate(3, after=8) == [9, 10, 11] and pool.allocate(1, after=12) == [13]


def test_runs_that_do_not_fit_one_stretch_come_from_the_queue():
    pool = BlockPool(6)
    pool.allocate(6)
    pool.free([2, 5])
    with pytest.raises(ValueError, match="only 2 are free"):
        pool.allocate_runs([2, 1])
    assert pool.allocate_runs([1, 1]) == [[2], [5]] and pool.num_free == 0


def test_shared_block_returns_to_the_pool_only_with_its_last_reference():
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    pool.fork([block])
    pool.free([block])
    assert not pool.is_free(block) and pool.num_free == 1
    pool.free([block])
    assert pool.is_free(block) and pool.num_free == 2


def test_allocate_more_than_free_changes_nothing():
    pool = BlockPool(3)
    pool.allocate(2)
    with pytest.raises(ValueError, match="only 1 are free"):
        pool.allocate(2)
    assert pool.num_free == 1


def _pool_state(pool: BlockPool) -> tuple:
    return pool.num_blocks, pool.num_free, pool.free_ids(), pool.ref_counts()


@pytest.mark.parametrize("bad", [-2, -1, 1.5, True, "3"])
def test_grow_rejects_a_count_that_is_not_an_int_ge_0_and_changes_nothing(bad):
    pool = BlockPool(4)
    pool.allocate(1)
    before = _pool_state(pool)
    with pytest.raises(ValueError, match=r"`extra_blocks` must be an int >= 0 \(a pool never shrinks\)"):
        pool.grow(bad)
    assert _pool_state(pool) == before
    pool.grow(0)  # growing by nothing is allowed and does nothing
    assert _pool_state(pool) == before


def test_an_empty_pool_hands_out_nothing_until_it_grows():
    pool = BlockPool(0)
    with pytest.raises(ValueError, match="only 0 are free"):
        pool.allocate(1)
    pool.grow(2)
    assert pool.allocate(2) == [1, 2] and pool.num_free == 0
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(-1)


def test_remap_moves_references_bumps_every_epoch_and_shrink_drops_free_ids_at_the_end():
    pool = BlockPool(6)
    a, b, c = pool.allocate(3)
    pool.fork([c])
    pool.free([a])
    epochs = [pool.epoch(block) for block in range(7)]
    with pytest.raises(ValueError, match="every referenced block"):
        pool.remap({b: 1})  # c is missing
    pool.remap({b: 1, c: 2})
    assert [pool.ref_count(block) for block in range(1, 7)] == [1, 2, 0, 0, 0, 0] and pool.num_free == 4
    assert all(pool.epoch(block) == epochs[block] + 1 for block in range(1, 7))
    assert pool.allocate(1) == [3]  # the free queue is rebuilt low ids first
    with pytest.raises(ValueError, match="must be free"):
        pool.shrink(2)
    before = _pool_state(pool)
    for bad in (-1, 7, True):
        with pytest.raises(ValueError, match="cannot shrink"):
            pool.shrink(bad)
    assert _pool_state(pool) == before
    pool.shrink(4)
    assert pool.num_blocks == 4 and pool.num_free == 1 and pool.allocate(1) == [4]
    with pytest.raises(ValueError, match="only 0 are free"):
        pool.allocate(1)


def test_every_way_of_allocating_bumps_the_epoch():
    """Epochs tell a reused id from the block it was (prefix cache, sealed copies): no allocation may skip it."""
    pool = BlockPool(12)
    before = [pool.epoch(block) for block in range(13)]
    taken = [*pool.allocate(2), *(block for run in pool.allocate_runs([2, 3]) for block in run)]
    assert all(pool.epoch(block) == before[block] + 1 for block in taken)
    assert all(pool.epoch(block) == before[block] for block in range(1, 13) if block not in taken)


def test_a_fixed_pool_raises_naming_the_group_and_changes_nothing():
    pool = BlockPool(4)
    pool.allocate(3)
    before = _pool_state(pool)
    assert pool.shortfall(1) == 0 and pool.shortfall(3) == 2 and pool.shortfall(3, freed=2) == 0
    assert pool.check_reserve(1, group="full", block_size=16) == 0
    pool.reserve(3, group="full", block_size=16, freed=2)  # fits once the step's freed blocks are back
    for call in (pool.check_reserve, pool.reserve):
        with pytest.raises(OutOfBlocksError, match="its full layers: this step needs 3 blocks but only 2 of 4 "):
            call(3, group="full", block_size=16, freed=1)
    assert _pool_state(pool) == before


@pytest.mark.parametrize("in_use", [0, 1, 4, 10, 100])
def test_a_growable_pool_grows_to_the_grown_size_of_what_it_will_hold(in_use):
    pool = BlockPool(in_use, growable=True)
    pool.allocate(in_use)
    assert pool.check_reserve(0, group="g", block_size=4) == 0
    extra = pool.check_reserve(3, group="g", block_size=4, freed=1)
    assert extra == grown_size(in_use - 1 + 3) - in_use and pool.num_blocks == in_use  # the check changes nothing
    pool.reserve(3, group="g", block_size=4, freed=1)
    assert pool.num_blocks == grown_size(in_use + 2)
    assert grown_size(in_use) == max(in_use, int(GROWTH * in_use) - 1)


def test_free_ids_and_ref_counts_are_read_only_views():
    pool = BlockPool(4)
    a, b, c, d = pool.allocate(4)
    pool.fork([b])
    pool.free([c, a])
    assert pool.free_ids() == [c, a] and pool.ref_counts() == (1, 0, 2, 0, 1)
    pool.free_ids().clear()
    assert pool.free_ids() == [c, a] and pool.used_ids() == [b, d]
