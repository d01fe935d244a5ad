"""The attention math of the torch path and the keyword contract of the "paged" attention: below layers/, which
read them; the attention function itself is `hf_paged_cache.paged_attention`."""
