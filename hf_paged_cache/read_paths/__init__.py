"""The ways the `"paged"` attention reads K/V from blocks: `selector.py` decides which path reads each token; each
other module is one path (`triton`, `kernel_rows`, `cascade`, `batched_decode`, `quantized`, `rows`)."""
