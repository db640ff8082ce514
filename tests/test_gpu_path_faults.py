"""GPU-path faults that a reading of torch's, accelerate's, bitsandbytes' and NCCL's sources found and
no CPU test saw; each test here failed before its fix."""

from __future__ import annotations

import json
import subprocess
from types import SimpleNamespace
from typing import Any

import pytest

# -- the compile-cache child of a slice calibration built the whole model ---------------------------


def test_the_compile_cache_child_of_a_slice_builds_the_slice(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under `--layers` the workload is a 2-layer slice of an 8B: the child process that times the
    cached compile must build those 2 layers, not the 32 that the preset's name alone gives (32 GB of
    fp32 weights: out of memory exactly where slices were chosen)."""
    import bench.compile_probe as compile_probe
    import train.step.engine as engine
    import train.step.runtime as runtime
    from bench.layer_slices import slice_spec
    from bench.probe_tasks import measure_cached_compile
    from train.workload.method import MethodConfig
    from train.workload.model import make_config, resolve_model

    started: list[list[str]] = []

    def child(command: list[str], **options: Any) -> subprocess.CompletedProcess:
        started.append(command)
        return subprocess.CompletedProcess(command, 0, stdout=json.dumps({"first_step_seconds": 3.0, "step_seconds": 1.0}), stderr="")

    monkeypatch.setattr(compile_probe.subprocess, "run", child)
    sliced = slice_spec(resolve_model("llama-3.1-8b"), 2)
    workload = SimpleNamespace(spec=sliced, method=MethodConfig(), engine=SimpleNamespace(loss="plain"), release=lambda: None)
    assert measure_cached_compile(workload, {"micro_batch_size": 1, "seq_len": 64}, 60.0)["first_step_seconds"] == 3.0

    built: list[Any] = []

    class Built(Exception):
        pass

    def capture(spec: Any, *arguments: Any) -> None:
        built.append(spec)
        raise Built

    monkeypatch.setattr(engine, "engine_from_options", capture)
    monkeypatch.setattr(runtime, "make_accelerator", lambda *arguments: None)
    with pytest.raises(Built):  # the child's own reading of the request, up to the model it builds
        compile_probe.main([started[0][-1]])
    assert make_config(built[0]).num_hidden_layers == 2
    assert not built[0].load_weights
