"""Hub ids `ORG/NAME[@REV]` for bench and train, from a hub cache built on disk (issue 23).

The cache is laid out as huggingface_hub writes it (`models--ORG--NAME/snapshots/<commit>` and
`refs/main`) with a small model saved by `save_pretrained` and a BPE tokenizer trained here with a
chat template of its own. Nothing is downloaded: the hub is either offline or faked.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers import assert_one_line_error, load_tokenized, run_main

from benchtrain.common.errors import BenchtrainError
from benchtrain.train.workload.hub import parse_hub_id
from benchtrain.train.workload.model import PRESETS, ModelSpec, resolve_model, with_hub_weights

REPO = "org/tiny-chat"
REVISION = "0123456789abcdef0123456789abcdef01234567"
# ChatML, unlike the byte tokenizer's template: final/ must keep this one.
CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
WORDS = "the model answers questions about trains deadlines batches tokens and weights in short sentences".split()


def conversation(index: int) -> list[dict[str, str]]:
    question = " ".join(WORDS[(index + k) % len(WORDS)] for k in range(2 + index % 3))
    answer = " ".join(WORDS[(index * 3 + k) % len(WORDS)] for k in range(1 + index % 3))
    return [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": question},
        {"role": "assistant", "content": answer},
    ]


def trained_tokenizer() -> Any:
    """A byte-level BPE trained offline on a few sentences, with ChatML as its chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(
        [" ".join(WORDS)] * 20 + [turn["content"] for i in range(40) for turn in conversation(i)], trainer
    )
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tokenizer.chat_template = CHATML
    return tokenizer


# The tiny preset's shape with what a real config.json adds (token ids, epsilon, architectures):
# it shares the preset's fingerprint, so calibrations too.
HUB_CONFIG = {
    **PRESETS["tiny"],
    "bos_token_id": 0,
    "eos_token_id": 2,
    "rms_norm_eps": 1e-5,
    "architectures": ["LlamaForCausalLM"],
}


@pytest.fixture(scope="module")
def hub_model() -> tuple[Any, Any]:
    """(tokenizer, model) to save into the cache; the weights differ from a fresh build's (seed 0)."""
    import torch
    from transformers import AutoModelForCausalLM

    from benchtrain.train.workload.model import make_config

    tokenizer = trained_tokenizer()
    assert len(tokenizer) <= HUB_CONFIG["vocab_size"]
    torch.manual_seed(123)
    model = AutoModelForCausalLM.from_config(make_config(ModelSpec(REPO, HUB_CONFIG)))
    return tokenizer, model


def cache_model(hub: Path, tokenizer: Any, model: Any, weights: bool, repo: str = REPO) -> Path:
    """Save into `hub` as a download would have: snapshots/<commit> and refs/main."""
    root = hub / f"models--{repo.replace('/', '--')}"
    snapshot = root / "snapshots" / REVISION
    snapshot.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(snapshot)
    if weights:
        model.save_pretrained(snapshot)
    else:
        model.config.save_pretrained(snapshot)
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / "main").write_text(REVISION)
    return snapshot


def chat_file(path: Path, count: int = 40) -> Path:
    path.write_text("".join(json.dumps({"messages": conversation(i)}) + "\n" for i in range(count)))
    return path


def test_hub_ids_are_told_apart_from_presets_and_folders() -> None:
    assert parse_hub_id("Qwen/Qwen2.5-7B-Instruct") == ("Qwen/Qwen2.5-7B-Instruct", None)
    assert parse_hub_id("meta-llama/Llama-3.1-8B@v1.0") == ("meta-llama/Llama-3.1-8B", "v1.0")
    assert parse_hub_id(f"{REPO}@{REVISION}") == (REPO, REVISION)
    for not_an_id in ("tiny", "./my-model", "/abs/path", "a/b/c", "org/"):
        assert parse_hub_id(not_an_id) is None


def test_a_hub_config_shares_calibrations_with_the_preset_of_its_shape() -> None:
    # config.json as the hub serves Qwen/Qwen2.5-7B-Instruct and meta-llama/Llama-3.1-8B-Instruct.
    qwen = {
        "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645,
        "hidden_act": "silu", "hidden_size": 3584, "initializer_range": 0.02, "intermediate_size": 18944,
        "max_position_embeddings": 32768, "max_window_layers": 28, "model_type": "qwen2", "num_attention_heads": 28,
        "num_hidden_layers": 28, "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
        "sliding_window": 131072, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.43.1",
        "use_cache": True, "use_sliding_window": False, "vocab_size": 152064,
    }  # fmt: skip
    llama = {
        "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 128000,
        "eos_token_id": [128001, 128008, 128009], "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
        "intermediate_size": 14336, "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
        "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
        "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.43.0.dev0",
        "use_cache": True, "vocab_size": 128256,
    }  # fmt: skip
    assert ModelSpec("Qwen/Qwen2.5-7B-Instruct", qwen).fingerprint == resolve_model("qwen2.5-7b").fingerprint
    assert ModelSpec("meta-llama/Llama-3.1-8B-Instruct", llama).fingerprint == resolve_model("llama-3.1-8b").fingerprint
    # A different shape is a different fingerprint.
    assert ModelSpec("x", {**qwen, "num_hidden_layers": 24}).fingerprint != resolve_model("qwen2.5-7b").fingerprint


@pytest.mark.slow
def test_bench_calibrates_a_cached_hub_model_from_its_config_and_train_trains_it_with_its_template(
    offline_hub: Path, home: Path, tmp_path: Path, hub_model: tuple[Any, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer, model = hub_model
    snapshot = cache_model(offline_hub, tokenizer, model, weights=False)  # config and tokenizer only
    data = chat_file(tmp_path / "chats.jsonl")

    # bench: the config is enough (random weights, as for presets); the lengths come from the data.
    grid = [
        "--batch-sizes",
        "1,2",
        "--workers",
        "0",
        "--accum",
        "1",
        "--max-probe-seconds",
        "0.2",
        "--quiet",
        "--no-report",
    ]
    code, _, err = run_main("bench", ["run", "--gpu", "cpu", "--model", REPO, "--data", str(data), *grid], capsys)
    assert code == 0, err
    calibration = json.loads(next((home / "calibrations").glob("*.json")).read_text())
    assert (
        calibration["model"]["hub_id"] == REPO
        and calibration["model"]["revision"] == REVISION
        and calibration["model"]["source"] == "hub"
    )
    # shared with the preset of its shape
    assert calibration["model"]["fingerprint"] == resolve_model("tiny").fingerprint
    longest = max(
        len(
            tokenizer(tokenizer.apply_chat_template(conversation(i), tokenize=False), add_special_tokens=False)[
                "input_ids"
            ]
        )
        for i in range(40)
    )
    lengths = calibration["search"]["space"]["seq_lens"]
    # data's longest, rounded up; 3 lengths as by default
    assert lengths[-1] == -(-longest // 64) * 64 and len(lengths) == 3, lengths

    # train needs the weights: offline and not cached is one line with the download command.
    train_argv = [
        "--model",
        REPO,
        "--data",
        str(data),
        "--deadline",
        "30m",
        "--effective-batch",
        "4",
        "--max-steps",
        "2",
        "--no-report",
    ]
    code, _, err = run_main("train", train_argv, capsys)
    assert_one_line_error(code, err, f"hf download {REPO} --revision {REVISION}")
    assert not (home / "runs").exists() or not list((home / "runs").iterdir())

    cache_model(offline_hub, tokenizer, model, weights=True)
    code, _, err = run_main("train", train_argv, capsys)
    assert code == 0, err
    run_dir = next((home / "runs").iterdir())
    assert run_dir.name.startswith("org--tiny-chat-")
    record = json.loads((run_dir / "run.json").read_text())
    assert record["model"]["hub_id"] == REPO and record["model"]["revision"] == REVISION
    assert record["data"]["format"] == "messages" and record["data"]["loss_on"] == "assistant turns"

    final = run_dir / "final"
    assert AutoTokenizer.from_pretrained(final).chat_template == CHATML
    loaded = AutoModelForCausalLM.from_pretrained(final)
    cached = AutoModelForCausalLM.from_pretrained(snapshot)
    embedding = loaded.get_input_embeddings().weight
    # Two small steps from the cached weights (init std 0.02), not from a fresh random build.
    assert (embedding - cached.get_input_embeddings().weight).abs().mean() < 0.005
    torch.manual_seed(0)
    fresh = AutoModelForCausalLM.from_config(loaded.config)
    assert (embedding - fresh.get_input_embeddings().weight).abs().mean() > 0.01


def test_the_data_is_tokenized_with_the_hub_model_s_template(
    offline_hub: Path, tmp_path: Path, hub_model: tuple[Any, Any]
) -> None:
    from helpers import trained_text

    from benchtrain.train.workload.tokenizer import load_tokenizer

    cache_model(offline_hub, *hub_model, weights=False)
    spec = resolve_model(REPO)
    tokenizer = load_tokenizer(spec.directory, None)
    data = load_tokenized(str(chat_file(tmp_path / "chats.jsonl", count=1)), tokenizer)
    assert tokenizer.decode(data.sample(0).tolist()).startswith(
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\n"
    )
    assert trained_text(tokenizer, data) == conversation(0)[2]["content"] + "<|im_end|>\n"


def test_offline_without_the_model_is_one_line_with_the_download_command(tmp_path: Path) -> None:
    """A fresh process, as a user runs it: HF_HOME and HF_HUB_OFFLINE from the environment."""
    env = {
        **os.environ,
        "HF_HOME": str(tmp_path / "hf"),
        "HF_HUB_OFFLINE": "1",
        "BENCHTRAIN_HOME": str(tmp_path / "home"),
    }
    done = subprocess.run(
        [sys.executable, "-m", "benchtrain.bench", "run", "--model", "org/absent"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().count("\n") == 0 and "Traceback" not in done.stderr
    assert "org/absent is not in the hub cache" in done.stderr and str(tmp_path / "hf" / "hub") in done.stderr
    assert "`hf download org/absent`" in done.stderr


def test_a_revision_that_is_not_cached_offline_names_it(
    offline_hub: Path, hub_model: tuple[Any, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    cache_model(offline_hub, *hub_model, weights=False)
    assert resolve_model(f"{REPO}@main").hub.revision == REVISION
    code, _, err = run_main("bench", ["run", "--model", f"{REPO}@v2"], capsys)
    assert_one_line_error(code, err, f"hf download {REPO} --revision v2")


def hub_error(kind: str) -> Exception:
    import httpx2
    from huggingface_hub import errors

    request = httpx2.Request("GET", "https://huggingface.co/api/models/org/x")
    if kind == "unreachable":  # what snapshot_download raises with no network and nothing cached
        error = errors.LocalEntryNotFoundError("An error happened while trying to locate the files on the Hub")
        error.__cause__ = httpx2.ConnectError("Name or service not known", request=request)
        return error
    if kind == "DryRunError":  # a gated repository seen through a dry run
        error = errors.DryRunError("Dry run cannot be performed as the repository cannot be accessed.")
        error.__cause__ = hub_error("GatedRepoError")
        return error
    response = httpx2.Response(401 if kind != "RevisionNotFoundError" else 404, request=request)
    return getattr(errors, kind)("refused", response=response)


@pytest.mark.parametrize(
    ("kind", "token", "fragment"),
    [
        (
            "GatedRepoError",
            None,
            "org/x is gated and no token is set: accept its terms on https://huggingface.co/org/x and set HF_TOKEN",
        ),
        ("GatedRepoError", "hf_secret", "is gated and the token in use has no access to it"),
        ("RepositoryNotFoundError", None, "no model org/x on the hub (if it is private, set HF_TOKEN): check the id"),
        ("RevisionNotFoundError", None, "hub model org/x has no revision 'v9'"),
        (
            "unreachable",
            None,
            "cannot reach the hub for model org/x (Name or service not known) and it is not in the hub cache",
        ),
        ("DryRunError", None, "org/x is gated and no token is set"),
    ],
)
def test_hub_refusals_are_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], kind: str, token: str | None, fragment: str
) -> None:
    import huggingface_hub
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: token)

    def refuse(*_args: Any, **_kwargs: Any) -> str:
        raise hub_error(kind)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", refuse)
    code, _, err = run_main(
        "bench", ["run", "--model", "org/x@v9" if kind == "RevisionNotFoundError" else "org/x"], capsys
    )
    assert_one_line_error(code, err, fragment)
    assert "hf_secret" not in err


def test_train_says_how_many_gb_it_will_fetch_and_where_then_fetches(
    offline_hub: Path, hub_model: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Online (faked): the weights' size from huggingface_hub's dry run, said before the download."""
    import huggingface_hub
    from huggingface_hub import constants
    from huggingface_hub.file_download import DryRunFileInfo

    tokenizer, model = hub_model
    snapshot = cache_model(offline_hub, tokenizer, model, weights=False)
    spec = resolve_model(REPO)
    assert not spec.has_weights
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    calls: list[dict[str, Any]] = []
    size = 1_234_000_000

    def fake_snapshot_download(repo_id: str, **kwargs: Any) -> Any:
        calls.append(kwargs)
        if kwargs.get("dry_run"):
            assert kwargs["revision"] == REVISION  # the commit bench and the plan saw, not whatever main is now
            if "*.safetensors" not in kwargs["allow_patterns"]:
                return []
            return [
                DryRunFileInfo(REVISION, size, "model.safetensors", str(snapshot / "model.safetensors"), False, True)
            ]
        if "*.safetensors" in kwargs["allow_patterns"]:
            model.save_pretrained(snapshot)
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    said: list[str] = []
    dry = with_hub_weights(spec, said.append, fetch=False)
    assert (
        not dry.has_weights
        and len(said) == 1
        and all(fact in said[0] for fact in ("will fetch", "1.2 GB", REPO, str(offline_hub)))
    )
    loaded = with_hub_weights(spec, said.append)
    assert all(fact in said[-1] for fact in ("fetching", "1.2 GB", REPO, str(offline_hub)))
    assert (
        loaded.has_weights
        and not calls[-1].get("dry_run")
        and calls[-1]["allow_patterns"] == ["*.safetensors", "*.safetensors.index.json"]
    )

    # More than the disk holds: refused before the download, with where and how much.
    (snapshot / "model.safetensors").unlink()
    size = 10**18
    with pytest.raises(BenchtrainError, match=r"needs 1000000000.0 GB in the hub cache"):
        with_hub_weights(resolve_model(REPO), said.append)


def test_a_lora_adapter_names_the_hub_model_and_commit_as_its_base(
    offline_hub: Path, tmp_path: Path, hub_model: tuple[Any, Any]
) -> None:
    import torch
    from peft import PeftConfig, PeftModel
    from transformers import AutoModelForCausalLM

    from benchtrain.train.export import export_final
    from benchtrain.train.workload.method import MethodConfig
    from benchtrain.train.workload.model import build_model

    tokenizer, model = hub_model
    snapshot = cache_model(offline_hub, tokenizer, model, weights=True)
    spec = with_hub_weights(resolve_model(REPO))
    method = MethodConfig(method="lora", lora_rank=4)
    trained = build_model(spec, "cpu", method)
    record = export_final(tmp_path / "run", trained, tokenizer, spec, method)
    assert (
        record["base_model_name_or_path"] == REPO and record["base_revision"] == REVISION and "base_path" not in record
    )
    config = PeftConfig.from_pretrained(record["path"])
    assert (config.base_model_name_or_path, config.revision) == (REPO, REVISION)
    # The adapter sits on the cached weights: base + adapter is the model that was trained.
    restored = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(snapshot), record["path"])
    prompt = torch.tensor([[5, 17, 99, 42]])
    with torch.no_grad():
        assert torch.allclose(restored(input_ids=prompt).logits, trained(input_ids=prompt).logits, atol=1e-5)


def test_a_resumed_run_keeps_the_commit_it_started_from(offline_hub: Path, hub_model: tuple[Any, Any]) -> None:
    from benchtrain.calibration.run_file import ResumedRun
    from benchtrain.train.running.resume import resumed_spec

    newer = "f" * 40
    cache_model(offline_hub, *hub_model, weights=False).rename(
        offline_hub / "models--org--tiny-chat" / "snapshots" / newer
    )
    cache_model(offline_hub, *hub_model, weights=False)  # the commit the run started from, still cached
    (offline_hub / "models--org--tiny-chat" / "refs" / "main").write_text(newer)  # main has moved on since
    spec = resolve_model(REPO)
    assert spec.hub.revision == newer

    def run(model: dict[str, str]) -> ResumedRun:
        row = {"micro_batch_size": 1, "grad_accum": 1, "num_workers": 0, "seq_len": 64, "gradient_checkpointing": 0}
        return ResumedRun.of(
            {"run_id": "old", "model": model, "plan": {"optimizer_steps": 4, "epochs": 1.0, "configuration": row}},
            "run.json",
        )

    assert resumed_spec(spec, run({"revision": REVISION})).hub.revision == REVISION
    assert resumed_spec(spec, run({"name": "tiny"})) is spec
