"""The simulator: the real sessions and codec over a paced, lossy link in simulated time (engine, handoff
set-up, split compute), the clairvoyant oracle, ARQ models and the seeded loss models."""
