"""What only runs on a GPU, checked on CPU with a fake CUDA: the peak-FLOPs table and the hardware
record, the step timer's CUDA events, and the allocator's peak memory."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from benchtrain.train.step.hardware import detect_hardware, device_label, peak_flops


@pytest.mark.parametrize(
    ("name", "entry", "flops"),
    [
        ("NVIDIA H100 80GB HBM3", "H100 SXM", 989e12),
        ("NVIDIA H100 PCIe", "H100 PCIe", 756e12),
        ("NVIDIA H100 NVL", "H100 NVL", 835e12),
        ("NVIDIA H200", "H200", 989e12),
        ("NVIDIA H200 NVL", "H200 NVL", 835e12),
        ("NVIDIA GH200 480GB", "GH200", 989e12),
        ("NVIDIA A100-SXM4-80GB", "A100", 312e12),
        ("NVIDIA L40S", "L40S", 362e12),
        ("NVIDIA L40", "L40", 181e12),
        ("NVIDIA L4", "L4", 121e12),
        ("NVIDIA GeForce RTX 4090", "RTX 4090", 165e12),
    ],
)
def test_peak_flops_of_each_device(name: str, entry: str, flops: float) -> None:
    assert peak_flops(name) == (entry, flops)


def test_an_unknown_device_has_no_peak() -> None:
    assert peak_flops("NVIDIA RTX A6000") is None and peak_flops("AMD EPYC 7B13") is None


def _fake_cuda(monkeypatch: pytest.MonkeyPatch, name: str, multiprocessors: int, memory: int = 80 * 2**30) -> None:
    properties = SimpleNamespace(total_memory=memory, major=9, minor=0, multi_processor_count=multiprocessors)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: properties)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: name)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)


def test_a_mig_slice_gets_its_share_of_the_peak(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 1g.10gb slice of an H100 has 16 of its 132 multiprocessors: 16/132 of the peak, not all of it."""
    _fake_cuda(monkeypatch, "NVIDIA H100 80GB HBM3 MIG 1g.10gb", 16, 10 * 2**30)
    hardware = detect_hardware()
    assert hardware["peak_bf16_flops"] == pytest.approx(989e12 * 16 / 132)
    assert hardware["peak_flops_entry"] == "H100 SXM MIG 16/132 SMs" and device_label(hardware) == "h100"
    _fake_cuda(monkeypatch, "NVIDIA H100 80GB HBM3", 132)
    assert detect_hardware()["peak_bf16_flops"] == 989e12  # the whole GPU


class _FakeEvent:
    log: list[str] = []  # noqa: RUF012 (shared by the two events of a timer, on purpose)

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.stream: object = None

    def record(self, stream: object = None) -> None:
        self.stream = stream
        _FakeEvent.log.append("record")

    def elapsed_time(self, end: _FakeEvent) -> float:
        assert _FakeEvent.log[-1] == "synchronize"  # read only once the GPU got there
        return 250.0  # milliseconds


def test_the_step_timer_times_the_gpu_with_events_on_its_own_device(monkeypatch: pytest.MonkeyPatch) -> None:
    from benchtrain.train.step.step import StepTimer

    device = torch.device("cuda", 1)
    _FakeEvent.log = []
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda where: f"stream of {where}")
    monkeypatch.setattr(
        torch.cuda,
        "synchronize",
        lambda where=None: _FakeEvent.log.append("synchronize") if where == device else pytest.fail(where),
    )
    timer = StepTimer(device)
    timer.start()
    assert timer.stop() == 0.25  # seconds, from the events' milliseconds
    assert _FakeEvent.log == ["record", "record", "synchronize"]  # one wait for the GPU per region
    assert timer._start.stream == timer._end.stream == "stream of cuda:1"


def test_peak_memory_on_cuda_is_the_allocators_peak_on_this_device(monkeypatch: pytest.MonkeyPatch) -> None:
    from benchtrain.train.step.peak_memory import PeakMemory

    device = torch.device("cuda", 1)
    calls: list[str] = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda where=None: calls.append(f"reset {where}"))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda where=None: 3 * 2**30 if where == device else 0)
    # Reserved, device totals: tests/test_memory_reserved.py holds what is made of them.
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda where=None: 4 * 2**30 if where == device else 0)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda where=None: 4 * 2**30 if where == device else 0)
    monkeypatch.setattr(
        torch.cuda, "mem_get_info", lambda where=None: (75 * 2**30, 80 * 2**30) if where == device else (0, 0)
    )
    with PeakMemory(device) as memory:
        assert calls == ["empty_cache", "reset cuda:1"]  # the previous probe's peak does not count
    assert memory.peak_bytes == 3 * 2**30
    assert memory.record() == {
        "peak_reserved_bytes": 4 * 2**30,
        "device_used_bytes": 5 * 2**30,
        "non_torch_bytes": 2**30,
    }
