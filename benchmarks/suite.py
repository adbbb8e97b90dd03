"""The whole suite, in the order it runs: consecutive benchmarks on the same swarm share it."""

from benchmarks import (
    concurrent_sessions,
    forward_throughput,
    generation_latency,
    server_memory,
    server_start,
    speculative,
)

SUITE = {
    **server_start.BENCHMARKS,
    "latency_tiny_llama": generation_latency.BENCHMARKS["latency_tiny_llama"],
    **concurrent_sessions.BENCHMARKS,
    "latency_smollm2": generation_latency.BENCHMARKS["latency_smollm2"],
    **forward_throughput.BENCHMARKS,
    **server_memory.BENCHMARKS,
    **speculative.BENCHMARKS,
}
