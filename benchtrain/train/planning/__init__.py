"""The plan to the deadline, from the calibration: planner, overheads, memory and disk checks,
communication, prices, and the plan as text."""
