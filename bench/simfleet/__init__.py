"""A simulated fleet for the benchmarks: engines and static-config gateways as child processes.

bench/routing.py and bench/isolation.py measure the gateway against
simulated engines (llmgw.sim.engine) with no control plane: each starts its
engines in one child process and its gateways, each given a fixed config
through a MemoryLink, in another. ``children`` starts, reads and stops those
processes; ``gateways`` is what runs in the gateways' process.
"""
