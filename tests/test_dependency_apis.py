"""The library APIs the code calls exist in what pyproject.toml lets pip install (issue 39).

The floors were `transformers>=4.46`, `peft>=0.13`, `accelerate>=1.0`, far below what the code calls
(`transformers.masking_utils.find_packed_sequence_indices`, `from_pretrained(dtype=…)`: before
transformers 4.56 that keyword was `torch_dtype`, and an unknown keyword is swallowed by **kwargs, so a
LoRA base silently loaded in fp32). Here an AST walk over bench/ train/ calibration/ common/ reports/ benchtrain/
collects every `from LIB… import NAME`, every attribute read off a library module and every keyword
passed to a library callable, and each must resolve in the installed versions; a keyword that only a
`**kwargs` takes must have a behaviour check below (KWARGS_CHECKED), since a signature cannot show it.
The floors themselves are held to the versions this suite has passed on (TESTED).
"""

from __future__ import annotations

import ast
import importlib
import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("bench", "train", "calibration", "common", "reports", "benchtrain")
LIBRARIES = ("transformers", "peft", "accelerate", "bitsandbytes", "huggingface_hub", "datasets")

# The floors pyproject.toml may name: the major.minor this suite passed on (2026-11: transformers
# 5.24.0, peft 0.21.2, accelerate 1.15.0, bitsandbytes 0.50.2, datasets 5.2.0, huggingface_hub 2.4.0).
# The API test below would prove an older version too: install it, run this file, then lower a floor.
TESTED = {
    "transformers": "5.24",  # dtype= (4.56, transformers PR #39782), masking_utils, quantizers.base.get_keys_to_not_convert
    "peft": "0.21",
    "accelerate": "1.15",
    "bitsandbytes": "0.50",
    "datasets": "5.2",
    "huggingface_hub": "2.4",  # imported by train/workload/hub.py and train/recipes/hub_push.py: declared, not transitive
}

# Where a library callable sends its **kwargs (its own signature shows none of them).
FORWARDS = {
    "transformers.AutoModelForCausalLM.from_pretrained": "transformers.PreTrainedModel.from_pretrained",
    "transformers.AutoModelForCausalLM.from_config": "transformers.PreTrainedModel._from_config",
    "transformers.quantizers.auto.AutoHfQuantizer.from_config": "transformers.quantizers.base.HfQuantizer.__init__",
}
# Keywords only a **kwargs takes, exercised by a behaviour test here (a signature cannot show them,
# and a keyword an old version does not know is swallowed silently: `dtype=` before transformers 4.56).
KWARGS_CHECKED = {
    ("transformers.AutoModelForCausalLM.from_config", "dtype"): "test_dtype_and_attention_reach_the_model",
    (
        "transformers.AutoModelForCausalLM.from_config",
        "attn_implementation",
    ): "test_dtype_and_attention_reach_the_model",
    ("transformers.AutoModelForCausalLM.from_pretrained", "dtype"): "test_dtype_and_attention_reach_the_model",
    (
        "transformers.AutoModelForCausalLM.from_pretrained",
        "attn_implementation",
    ): "test_dtype_and_attention_reach_the_model",
    (
        "transformers.AutoTokenizer.from_pretrained",
        "local_files_only",
    ): "test_a_tokenizer_built_from_tokenizers_keeps_its_special_tokens",
    (
        "transformers.PreTrainedTokenizerFast",
        "tokenizer_object",
    ): "test_a_tokenizer_built_from_tokenizers_keeps_its_special_tokens",
    (
        "transformers.PreTrainedTokenizerFast",
        "bos_token",
    ): "test_a_tokenizer_built_from_tokenizers_keeps_its_special_tokens",
    (
        "transformers.PreTrainedTokenizerFast",
        "eos_token",
    ): "test_a_tokenizer_built_from_tokenizers_keeps_its_special_tokens",
    (
        "transformers.PreTrainedTokenizerFast",
        "pad_token",
    ): "test_a_tokenizer_built_from_tokenizers_keeps_its_special_tokens",
}


@dataclass(frozen=True)
class Use:
    kind: str  # "import" (a module or a name from one), "attribute" (read off a library name), "keyword"
    target: str  # dotted: module[.name…]
    keyword: str
    where: str

    def __str__(self) -> str:
        return f"{self.where}: {self.target}{'(' + self.keyword + '=)' if self.keyword else ''}"


def dotted(node: ast.AST) -> tuple[str, list[str]] | None:
    """(root name, attributes) of `a.b.c`, or None when the chain does not start at a name."""
    chain: list[str] = []
    while isinstance(node, ast.Attribute):
        chain.append(node.attr)
        node = node.value
    return (node.id, list(reversed(chain))) if isinstance(node, ast.Name) else None


def library_names(tree: ast.AST, where: str) -> tuple[dict[str, str], list[Use]]:
    """Local name -> the library object it is bound to, and the imports themselves."""
    names: dict[str, str] = {}
    uses = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] in LIBRARIES:
            for alias in node.names:
                names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
                uses.append(Use("import", f"{node.module}.{alias.name}", "", where))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in LIBRARIES:
                    names[alias.asname or alias.name.split(".")[0]] = (
                        alias.name if alias.asname else alias.name.split(".")[0]
                    )
                    uses.append(Use("import", alias.name, "", where))
    return names, uses


def uses_in(source: str, where: str) -> list[Use]:
    tree = ast.parse(source)
    names, uses = library_names(tree, where)
    for node in ast.walk(tree):
        found = dotted(node) if isinstance(node, ast.Attribute) else None
        if found and found[0] in names:
            uses.append(Use("attribute", ".".join([names[found[0]], *found[1]]), "", where))
        called = dotted(node.func) if isinstance(node, ast.Call) else None
        if called and called[0] in names:
            target = ".".join([names[called[0]], *called[1]])
            uses += [Use("keyword", target, keyword.arg, where) for keyword in node.keywords if keyword.arg]  # type: ignore[union-attr]
    return uses


def library_uses() -> list[Use]:
    uses = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            uses += uses_in(path.read_text(encoding="utf-8"), str(path.relative_to(ROOT)))
    return sorted(set(uses), key=str)


def resolve(target: str) -> Any:
    """The object `target` names: the longest importable module prefix, then attributes."""
    parts = target.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for part in parts[cut:]:
            try:
                found = getattr(found, part)
            except AttributeError:  # a submodule not imported yet by its package
                found = importlib.import_module(f"{found.__name__}.{part}")
        return found
    raise ImportError(target)


USES = library_uses()


def test_the_walk_finds_what_the_code_calls() -> None:
    """The walk sees imports, module attributes and keywords (else the tests below prove nothing)."""
    seen = {(use.kind, use.target, use.keyword) for use in USES}
    assert ("attribute", "transformers.masking_utils.find_packed_sequence_indices", "") in seen
    assert ("keyword", "transformers.AutoModelForCausalLM.from_config", "dtype") in seen
    assert ("attribute", "bitsandbytes.optim.AdamW8bit", "") in seen
    assert ("import", "peft.LoraConfig", "") in seen
    assert {use.target.split(".")[0] for use in USES} == set(LIBRARIES)
    source = "import transformers.masking_utils as masking\nfrom peft import LoraConfig as L\nL(r=4)\nmasking.nope\n"
    assert {str(use) for use in uses_in(source, "x.py")} == {
        "x.py: transformers.masking_utils",
        "x.py: peft.LoraConfig",
        "x.py: peft.LoraConfig(r=)",
        "x.py: transformers.masking_utils.nope",
    }


@pytest.mark.parametrize("use", [use for use in USES if use.kind != "keyword"], ids=str)
def test_every_library_name_the_code_reads_resolves(use: Use) -> None:
    resolve(use.target)


def named_parameter(function: Any, keyword: str) -> bool:
    parameters = inspect.signature(function).parameters
    return keyword in parameters and parameters[keyword].kind not in (
        inspect.Parameter.VAR_KEYWORD,
        inspect.Parameter.POSITIONAL_ONLY,
    )


def reads_from_kwargs(function: Any, keyword: str) -> bool:
    """The function's own source reads `keyword` out of its **kwargs (kwargs.pop("keyword"…) and the like)."""
    try:
        source = inspect.getsource(function)
    except (OSError, TypeError):
        return False
    return f'"{keyword}"' in source or f"'{keyword}'" in source


@pytest.mark.parametrize("use", [use for use in USES if use.kind == "keyword"], ids=str)
def test_every_keyword_the_code_passes_is_taken(use: Use) -> None:
    """Named in the signature (of the callable or of what it forwards **kwargs to), read out of
    **kwargs by that code, or exercised by a behaviour test here."""
    callables = [resolve(use.target), *([resolve(FORWARDS[use.target])] if use.target in FORWARDS else [])]
    if (
        any(named_parameter(function, use.keyword) for function in callables)
        or (use.target, use.keyword) in KWARGS_CHECKED
    ):
        return
    assert any(reads_from_kwargs(function, use.keyword) for function in callables), (
        f"{use}: no parameter of that name, and no code of it reads one from **kwargs: add a behaviour test (KWARGS_CHECKED) or FORWARDS"
    )


def test_dtype_and_attention_reach_the_model(tmp_path: Path) -> None:
    """What train/workload/model.py asks of from_config and from_pretrained is what the model gets:
    bf16 weights (a version that ignored `dtype=` built fp32, twice the memory the plan priced) and SDPA."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=64,
    )
    built = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.bfloat16)
    assert {p.dtype for p in built.parameters()} == {torch.bfloat16} and built.config._attn_implementation == "sdpa"
    built.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(
        str(tmp_path), attn_implementation="sdpa", local_files_only=True, dtype=torch.bfloat16
    )
    assert {p.dtype for p in loaded.parameters()} == {torch.bfloat16} and loaded.config._attn_implementation == "sdpa"
    assert {
        p.dtype
        for p in AutoModelForCausalLM.from_pretrained(
            str(tmp_path), local_files_only=True, dtype=torch.float32
        ).parameters()
    } == {torch.float32}


def test_a_tokenizer_built_from_tokenizers_keeps_its_special_tokens(tmp_path: Path) -> None:
    """train/workload/tokenizer.py's byte-level tokenizer: PreTrainedTokenizerFast(tokenizer_object=…,
    bos/eos/pad=…), saved and read back with AutoTokenizer.from_pretrained(local_files_only=True)."""
    from tokenizers import Tokenizer, models
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    vocab = {"<s>": 0, "</s>": 1, "<pad>": 2, "a": 3}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="a")),
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
    )
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (0, 1, 2)
    tokenizer.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    assert (loaded.bos_token_id, loaded.eos_token_id, loaded.pad_token_id) == (0, 1, 2)


def floors() -> dict[str, str]:
    """Distribution (normalized) -> the `>=` floor pyproject.toml gives it."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    found = {}
    for line in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]:
        requirement = Requirement(line)
        lower = [spec.version for spec in requirement.specifier if spec.operator in (">=", "==", "~=")]
        found[canonicalize_name(requirement.name)] = lower[0] if lower else ""
    return found


@pytest.mark.parametrize("library", LIBRARIES)
def test_each_library_is_declared_with_a_floor_this_suite_passed_on(library: str) -> None:
    from importlib.metadata import version

    from packaging.utils import canonicalize_name
    from packaging.version import Version

    declared = floors()
    name = canonicalize_name(library)
    assert name in declared, f"the code imports {library}: pyproject.toml must declare it (>= {TESTED[library]})"
    assert declared[name] and Version(declared[name]) >= Version(TESTED[library]), (
        f"{library}>={declared[name]} is below {TESTED[library]}, the oldest this suite passed on"
    )
    assert Version(version(library)) >= Version(declared[name]), (
        f"the installed {library} {version(library)} is below the floor {declared[name]}"
    )
