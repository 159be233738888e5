"""KV memory: the per-layer K/V pool, the page allocator and the radix prefix cache."""
