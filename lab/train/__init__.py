"""The repair scheduler's training: Double-DQN by reinforcement learning, its episode distribution, the
held-out comparison with the heuristic, and FlEC-RT's parameter tuning."""
