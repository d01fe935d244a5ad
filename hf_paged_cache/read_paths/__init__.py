"""The ways the `"paged"` attention reads K/V from blocks, and the one module that decides which reads what
(`selector.py`)."""
