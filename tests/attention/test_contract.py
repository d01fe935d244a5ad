"""The keyword contract of the "paged" attention: every keyword transformers' models pass to an attention function
is either honoured or refused, never both."""

from __future__ import annotations

import pathlib
import re

import transformers

from hf_paged_cache.attention.contract import HONOURED, REFUSED

# The attention function's own parameters: a call may name them, they never reach its `**kwargs`.
PARAMETERS = {"module", "query", "key", "value", "attention_mask", "scaling", "dropout"}


def _call_keywords(text: str):
    """Top-level `name=` keywords of every `attention_interface(...)` call in a modeling file's text."""
    for match in re.finditer(r"attention_interface\(", text):
        depth, end = 1, match.end()
        while depth:
            depth += {"(": 1, ")": -1}.get(text[end], 0)
            end += 1
        level, top = 0, []
        for char in text[match.end() : end - 1]:
            level += (char in "([{") - (char in ")]}")
            top.append(char if level == 0 else " ")
        yield from re.findall(r"(?:^|,)\s*([A-Za-z_]\w*)\s*=(?!=)", "".join(top))


def test_every_keyword_transformers_passes_to_the_attention_is_classified():
    models = pathlib.Path(transformers.__file__).parent / "models"
    seen = {keyword for path in models.glob("*/modeling_*.py") for keyword in _call_keywords(path.read_text())}
    assert {"s_aux", "softcap", "sliding_window"} <= seen  # the scan finds the calls
    assert not seen - PARAMETERS - HONOURED.keys() - REFUSED.keys()
    assert not HONOURED.keys() & REFUSED.keys()
