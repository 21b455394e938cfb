"""The path controller's benchmarks (`pfec bench rate-control|traces|fairness`): told against measured rate,
real handoffs on moving links, and fairness to kernel TCP and to another handoff on one bottleneck."""
