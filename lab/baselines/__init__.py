"""The reliable-transport baselines: the same handoff over real kernel TCP and real QUIC on an
emulated link."""
