"""The run while it runs: the loop, the deadline guard, checkpoints, trackers, and the record."""
