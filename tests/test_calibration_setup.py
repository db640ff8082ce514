"""What a calibration measured, in words (calibration.setup): `bench list`, `bench show`, and why
`latest` preferred an older calibration over the newest."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from benchtrain.calibration.schema import read_calibration_file
from benchtrain.calibration.setup import Setup, describe_setup, setup_difference
from benchtrain.calibration.store import save_calibration
from benchtrain.calibration.training import base_phrase, quantize_value
from benchtrain.common.errors import guard_cli

FIXTURE = Path(__file__).parent / "fixtures" / "cpu-tiny-fullgrid.json"
TINY = Setup(model_name="tiny", model_fingerprint="e93a0dc2f32d106d", method="lora", lora_rank=16)


@pytest.fixture(scope="module")
def full() -> dict[str, Any]:
    """The fixture as read: full fine-tuning of `tiny`, checkpointing off, one process."""
    return read_calibration_file(FIXTURE)


def lora(data: dict[str, Any], rank: int = 16, **training: Any) -> dict[str, Any]:
    changed = copy.deepcopy(data)
    changed["training"] = {
        **changed["training"],
        "method": "lora",
        "lora": {"rank": rank, "alpha": 2.0 * rank, "dropout": 0.0},
        **training,
    }
    return changed


def processes(data: dict[str, Any], world_size: int, sharding: str) -> dict[str, Any]:
    changed = copy.deepcopy(data)
    changed["distributed"] = {"world_size": world_size, "backend": "gloo", "sharding": sharding}
    return changed


def renamed(data: dict[str, Any], new_id: str, **model: Any) -> dict[str, Any]:
    changed = copy.deepcopy(data)
    changed["id"] = new_id
    changed["model"] = {**changed["model"], **model}
    return changed


def test_full_fine_tuning_one_process(full: dict[str, Any]) -> None:
    assert describe_setup(full) == "full fine-tuning, checkpointing off, 1 process"


def test_lora_names_its_rank(full: dict[str, Any]) -> None:
    assert describe_setup(lora(full, rank=8)) == "LoRA r8, checkpointing off, 1 process"


def test_two_ddp_processes(full: dict[str, Any]) -> None:
    assert describe_setup(processes(full, 2, "ddp")) == "full fine-tuning, checkpointing off, 2 processes (ddp)"


def test_both_checkpointing_modes(full: dict[str, Any]) -> None:
    data = lora(full)
    for index, row in enumerate(data["measurements"]):
        row["gradient_checkpointing"] = index % 2
    assert describe_setup(data) == "LoRA r16, checkpointing off+on, 1 process"
    for row in data["measurements"]:
        row["gradient_checkpointing"] = 1
    assert describe_setup(data) == "LoRA r16, checkpointing on, 1 process"


def test_skipped_probes_did_not_measure_checkpointing(full: dict[str, Any]) -> None:
    data = copy.deepcopy(full)
    data["measurements"][0].update(status="skipped", gradient_checkpointing=1)
    assert "checkpointing off," in describe_setup(data)


def test_quantized_base(full: dict[str, Any]) -> None:
    assert describe_setup(lora(full, quantization="nf4")) == "LoRA r16 on a 4-bit base, checkpointing off, 1 process"
    assert (
        describe_setup(lora(full, quantization={"bits": 8}))
        == "LoRA r16 on an 8-bit base, checkpointing off, 1 process"
    )
    # One value per base, as --quantize spells it, whatever a calibration recorded; one phrase for prose.
    assert [quantize_value(value) for value in (None, "none", 4, "int8", "4bit", "4-bit", {"bits": 8})] == [
        "none",
        "none",
        "4bit",
        "8bit",
        "4bit",
        "4bit",
        "8bit",
    ]
    assert [base_phrase(value) for value in ("none", "4bit", "8bit")] == [
        "an unquantized base",
        "a 4-bit base",
        "an 8-bit base",
    ]


def test_difference_names_the_method(full: dict[str, Any]) -> None:
    chosen, newer = lora(full), renamed(full, "cpu-tiny-20261124-000000")
    assert (
        setup_difference(chosen, newer, TINY)
        == "the newer cpu-tiny-20261124-000000 measured full fine-tuning (this run: LoRA r16)"
    )


def test_difference_names_the_rank_only_where_the_run_gives_one(full: dict[str, Any]) -> None:
    chosen, newer = lora(full, rank=16), renamed(lora(full, rank=8), "cpu-tiny-5")
    assert setup_difference(chosen, newer, TINY) == "the newer cpu-tiny-5 measured LoRA r8 (this run: LoRA r16)"
    unranked = Setup(model_name="tiny", model_fingerprint=TINY.model_fingerprint, method="lora")
    assert setup_difference(chosen, newer, unranked).startswith("the newer cpu-tiny-5 (LoRA r8,")


def test_difference_names_the_model(full: dict[str, Any]) -> None:
    newer = renamed(lora(full), "cpu-gpt2-20261124-000000", name="gpt2", fingerprint="ad47884758f0cece")
    assert (
        setup_difference(lora(full), newer, TINY)
        == "the newer cpu-gpt2-20261124-000000 measured model gpt2 (this run: tiny)"
    )


def test_difference_names_the_processes(full: dict[str, Any]) -> None:
    newer = processes(renamed(lora(full), "cpu-tiny-2"), 2, "ddp")
    assert (
        setup_difference(lora(full), newer, TINY)
        == "the newer cpu-tiny-2 measured 2 processes (ddp) (this run: 1 process)"
    )
    # A 4-process run: the 1-process calibration (communication predicted) beat a newer 2-process one.
    run = Setup(
        model_name="tiny",
        model_fingerprint=TINY.model_fingerprint,
        method="lora",
        lora_rank=16,
        world_size=4,
        sharding="ddp",
    )
    assert (
        setup_difference(lora(full), newer, run)
        == "the newer cpu-tiny-2 measured 2 processes (ddp) (this run: 4 processes (ddp))"
    )


def test_difference_leaves_out_what_the_chosen_one_shares(full: dict[str, Any]) -> None:
    """Both measured 2 processes on a 1-process run: the processes did not decide, the method did."""
    chosen = processes(lora(full), 2, "ddp")
    newer = processes(renamed(full, "cpu-tiny-3"), 2, "ddp")
    assert (
        setup_difference(chosen, newer, TINY) == "the newer cpu-tiny-3 measured full fine-tuning (this run: LoRA r16)"
    )


def test_difference_of_several_aspects(full: dict[str, Any]) -> None:
    newer = processes(renamed(full, "cpu-gpt2-4", name="gpt2", fingerprint="ad47884758f0cece"), 2, "fsdp")
    assert setup_difference(lora(full), newer, TINY) == (
        "the newer cpu-gpt2-4 measured model gpt2 (this run: tiny), full fine-tuning (this run: LoRA r16), 2 processes (fsdp) (this run: 1 process)"
    )


def run_bench(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    from benchtrain.bench.cli import main

    code = guard_cli(main, argv)
    out, err = capsys.readouterr()
    assert code == 0, err
    return out


def test_bench_list_and_show_name_method_and_rank(
    home: Path, full: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    data = lora(full, rank=32)
    for index, row in enumerate(data["measurements"]):
        row["gradient_checkpointing"] = index % 2
    save_calibration(data)

    listing = run_bench(["list"], capsys)
    assert "LoRA r32, checkpointing off+on, 1 process" in listing

    shown = run_bench(["show", "latest"], capsys).splitlines()
    assert "  setup: LoRA r32, checkpointing off+on, 1 process" in shown[:5]
