"""FireQ's attention side: INT4 per-token K/V with FP8 scales, FP8 queries, decode attention over the INT4 cache
and the RPN / CRS key scalings (PyTorch reference)."""
