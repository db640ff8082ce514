"""Measuring: hardware detection, search space, probes, runner and the `bench` command."""

__version__ = "0.1.0"
