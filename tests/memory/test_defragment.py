"""Pool compaction: blocks in use packed to the low end of the pool, contents and outputs unchanged."""

from __future__ import annotations

import pytest
from batch_workloads import PRESSURE, random_prompts, tiny_model
from cache_state import stored_blocks

from hf_paged_cache.serving.generator import BatchConfig, BatchGenerator

pytestmark = pytest.mark.usefixtures("one_thread")

OPTIONS = {"max_new_tokens": 12, "block_size": 4, "max_batch_tokens": 16, "max_num_seqs": 3, "num_blocks": 48}


def _generator(options: dict) -> BatchGenerator:
    generator = BatchGenerator(tiny_model("llama_gqa"), **OPTIONS, **options)
    for prompt in random_prompts(PRESSURE, seed=10, prefix=8):
        generator.add_request(prompt)
    return generator


@pytest.mark.parametrize("options", [{}, {"quant": "int8", "residual_length": 4}], ids=["prefix-cached", "int8"])
@pytest.mark.parametrize("keep_free", [None, 6])
def test_compaction_packs_the_pool_and_changes_no_contents_or_outputs(options, keep_free):
    expected = [o.generated_tokens for o in _generator(options).run()]
    generator = _generator(options)
    while not (generator.finished and len(generator.requests.running) > 1):  # a request left holes behind
        generator.step()
    late = [request.output.request_id for request in generator.requests.waiting]
    before = [stored_blocks(request.cache) for request in generator.requests.running]
    fragmented, packed = generator.defragment(keep_free)
    assert any(f.holes for f in fragmented.values())
    assert all(f.holes == 0 and f.used == fragmented[name].used for name, f in packed.items())
    for request, contents in zip(generator.requests.running, before):
        assert all((a == b).all() for a, b in zip(stored_blocks(request.cache), contents))
    if keep_free is not None:  # a fixed pool keeps the size it was given
        assert all(f.blocks == fragmented[name].blocks == OPTIONS["num_blocks"] for name, f in packed.items())
    outputs = generator.run()
    assert [o.generated_tokens for o in outputs] == expected
    if not options and late:  # the prefix cache's entries on blocks in use moved with them
        assert sum(outputs[i].prefix_hit_tokens for i in late) > 0


def test_keep_free_shrinks_a_growable_pool_which_grows_again():
    options = {key: value for key, value in OPTIONS.items() if key != "num_blocks"}
    expected = [o.generated_tokens for o in _generator({}).run()]
    generator = BatchGenerator(tiny_model("llama_gqa"), **options)
    for prompt in random_prompts(PRESSURE, seed=10, prefix=8):
        generator.add_request(prompt)
    while not (generator.finished and len(generator.requests.running) > 1):
        generator.step()
    _fragmented, packed = generator.defragment(keep_free=1)
    assert all(f.blocks == f.used + 1 for f in packed.values())
    layer = generator.template.paged_layers[0]
    assert layer.key_blocks.shape[0] == layer.tables.pool.num_blocks + 1
    assert [o.generated_tokens for o in generator.run()] == expected


def test_bad_compaction_knobs_fail_clearly():
    with pytest.raises(ValueError, match="keep_free"):
        _generator({}).defragment(keep_free=-1)
    with pytest.raises(ValueError, match="defragment_threshold"):
        BatchConfig(defragment_threshold=0)


def test_automatic_compaction_keeps_fragmentation_under_the_threshold():
    expected = [o.generated_tokens for o in _generator({}).run()]
    generator = _generator({"defragment_threshold": 0.2})
    assert [o.generated_tokens for o in generator.run()] == expected
    assert generator.metrics().defragmentations > 0
    assert all(m.fragmentation <= 0.2 for m in generator.history)
    plain = _generator({})
    plain.run()
    assert max(m.fragmentation for m in plain.history) > 0.2 and plain.metrics().defragmentations == 0


def test_the_names_that_called_defragmenting_compacting_still_work_with_a_warning():
    """`compact`, `compact_threshold` and `compactions` predate the glossary ("compact" is what eviction does)."""
    with pytest.warns(FutureWarning, match="defragment_threshold"):
        assert BatchConfig(compact_threshold=0.5).defragment_threshold == 0.5
    with pytest.raises(ValueError, match="defragment_threshold` alone"), pytest.warns(FutureWarning):
        BatchConfig(compact_threshold=0.5, defragment_threshold=0.4)
    generator = _generator({})
    generator.step()
    with pytest.warns(FutureWarning, match="`defragment`"):
        generator.compact()
    with pytest.warns(FutureWarning, match="`defragmentations`"):
        assert generator.metrics().compactions == 0  # a snapshot of the step before the call
