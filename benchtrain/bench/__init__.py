"""Measuring: search space, probes, runner, calibration record and the `bench` command."""
