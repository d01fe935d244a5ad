"""Unit tests of hf_paged_cache/quantization/ (a package: its module names, like test_packing, recur elsewhere)."""
