"""The whole suite, in the order it runs: consecutive benchmarks on the same swarm share it."""

from benchmarks import (
    api_overhead,
    cache_budget,
    cache_kinds,
    cache_pressure,
    chat_turns,
    concurrent_sessions,
    deepseek_latent,
    forward_throughput,
    generation_latency,
    packed_speed,
    private_swarm,
    server_memory,
    server_start,
    speculative,
    swarm_scale,
    transport_floor,
    tune,
    wan_latency,
)

SUITE = {
    **server_start.BENCHMARKS,
    **transport_floor.BENCHMARKS,
    "latency_tiny_llama": generation_latency.BENCHMARKS["latency_tiny_llama"],
    **private_swarm.BENCHMARKS,  # on latency_tiny_llama's swarm (its public one)
    **concurrent_sessions.BENCHMARKS,
    "latency_tiny_llama_1t": generation_latency.BENCHMARKS["latency_tiny_llama_1t"],  # a swarm at one thread
    "latency_smollm2": generation_latency.BENCHMARKS["latency_smollm2"],
    **api_overhead.BENCHMARKS,  # on latency_smollm2's swarm
    **forward_throughput.BENCHMARKS,
    **tune.BENCHMARKS,  # on forward_throughput's swarm
    "latency_smollm2_1t": generation_latency.BENCHMARKS["latency_smollm2_1t"],
    **chat_turns.BENCHMARKS,  # a swarm of its own, behind proxies
    **cache_pressure.BENCHMARKS,  # a server of its own whose cache holds 3 of its 8 sessions
    **server_memory.BENCHMARKS,
    **wan_latency.BENCHMARKS,
    **speculative.BENCHMARKS,
    **swarm_scale.BENCHMARKS,  # no swarm: a simulation
    **cache_kinds.BENCHMARKS,  # no swarm: one block's cache in this process
    **cache_budget.BENCHMARKS,  # no swarm: a server's cache budget in this process
    **deepseek_latent.BENCHMARKS,  # no swarm: one DeepSeek layer in three forms in this process
    **packed_speed.BENCHMARKS,  # no swarm: one block per checkpoint format, packed and dequantized
}
