"""petals-core benchmarks: the product against plain transformers, as ratios (see README, Benchmarks)."""
