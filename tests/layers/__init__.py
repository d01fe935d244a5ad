"""Unit tests of hf_paged_cache/layers/ (a package: its module names, like test_shared, recur elsewhere)."""
