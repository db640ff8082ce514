"""THE training step and what it runs on: engine, step, loss, compile, sharding, runtime, hardware,
metrics, peak memory, and the evaluation pass."""
