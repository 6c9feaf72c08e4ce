"""Plan caches: in memory (shape-keyed LRU with pins and budgets) and on disk (DSP1 entries)."""
