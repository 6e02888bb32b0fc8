"""Training: mesh and sharding rules, optimisers, objectives, checkpoints, metrics, the loop."""
