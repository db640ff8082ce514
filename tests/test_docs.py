"""The documentation agrees with the code: every option the commands accept is in docs/usage.md and
every option docs/usage.md names exists; the README stays a first page whose test command is the
one CI runs; relative links in the docs point at files that exist."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

from benchtrain.bench.cli import build_parser as bench_parser
from benchtrain.common.errors import BenchtrainError
from benchtrain.reports.cli import build_parser as report_parser
from benchtrain.train.cli import build_parser as train_parser
from benchtrain.train.cli import push_parser

ROOT = Path(__file__).resolve().parent.parent
USAGE = ROOT / "docs" / "usage.md"
# Options of the tools benchtrain runs under or beside (accelerate, torchrun, pip, hf), which the
# usage page shows in its command lines.
OTHER_TOOLS = {
    "--num_processes",
    "--nproc_per_node",
    "--num_machines",
    "--machine_rank",
    "--main_process_ip",
    "--main_process_port",
    "--cpu",
    "--revision",
    "--standalone",
}
MISTYPED = {"--dealine"}  # the usage page's example of a mistyped option
OPTION = re.compile(r"(?<![\w-])--[a-z][a-z0-9_-]*[a-z0-9]")


def parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """A parser and every subcommand's parser below it."""
    found = [parser]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                found.extend(parsers(child))
    return found


def accepted_options() -> set[str]:
    options: set[str] = set()
    for root in (bench_parser(), train_parser(), push_parser(), report_parser()):
        for parser in parsers(root):
            for action in parser._actions:
                options.update(flag for flag in action.option_strings if flag.startswith("--") and flag != "--help")
    return options


def test_every_option_a_command_accepts_is_in_the_usage_page() -> None:
    named = set(OPTION.findall(USAGE.read_text()))
    missing = sorted(accepted_options() - named)
    assert not missing, f"options missing from docs/usage.md: {missing}"


def test_every_option_the_usage_page_names_exists() -> None:
    named = set(OPTION.findall(USAGE.read_text()))
    unknown = sorted(named - accepted_options() - OTHER_TOOLS - MISTYPED)
    assert not unknown, f"docs/usage.md names options no command accepts: {unknown}"


def test_the_readme_is_a_first_page_whose_test_command_ci_runs() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    ci = (ROOT / ".ci" / "run").read_text().split()
    assert "bash scripts/test.sh" in readme and ci[-2:] == ["bash", "scripts/test.sh"]
    assert "bash scripts/demo.sh" in readme and (ROOT / "scripts" / "demo.sh").is_file()


def test_relative_links_in_the_docs_point_at_files_that_exist() -> None:
    pages = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" not in target and not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)} → {target}")
    assert not broken, f"broken links: {broken}"


def command_lines(page: Path) -> list[list[str]]:
    """The `bench`, `train` and `report` command lines in a page's code blocks (those under
    accelerate launch or torchrun from their `-m` on), continuation lines joined, comments cut;
    lines that elide a part (`…`) are left out."""
    found = []
    for block in re.findall(r"```bash\n(.*?)```", page.read_text(), flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line.replace("<run id>", "RUN").split("  #")[0].split(" # ")[0], comments=True)
            if "-m" in words:
                words = words[words.index("-m") + 1 :]
            if words and words[0] in ("bench", "train", "report") and "…" not in line:
                found.append(words)
    return found


def test_every_command_line_in_the_readme_and_the_usage_page_parses() -> None:
    lines = command_lines(ROOT / "README.md") + command_lines(USAGE)
    assert len(lines) > 40
    builders = {"bench": bench_parser, "train": train_parser, "report": report_parser}
    refused = []
    for words in lines:
        parser = push_parser() if "--push-only" in words else builders[words[0]]()
        try:
            parser.parse_args([word for word in words[1:] if word != "--push-only"])
        except (SystemExit, BenchtrainError):
            refused.append(" ".join(words))
    assert not refused, f"command lines the parsers refuse: {refused}"


def heading_anchors(page: Path) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces as
    hyphens, a repeated heading numbered."""
    anchors: set[str] = set()
    for heading in re.findall(r"^#+ (.+)$", page.read_text(), flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        anchor, repeat = slug, 0
        while anchor in anchors:
            repeat += 1
            anchor = f"{slug}-{repeat}"
        anchors.add(anchor)
    return anchors


def test_every_pointer_from_the_code_into_the_docs_lands_on_a_heading() -> None:
    pointers = set()
    for module in (ROOT / "benchtrain").rglob("*.py"):
        pointers.update(re.findall(r"docs/([\w-]+\.md)#([\w-]+)", module.read_text()))
    assert len(pointers) > 20
    missing = sorted(
        f"docs/{page}#{anchor}" for page, anchor in pointers if anchor not in heading_anchors(ROOT / "docs" / page)
    )
    assert not missing, f"code points at headings the docs do not have: {missing}"


ARCHITECTURE = ROOT / "docs" / "architecture.md"
PACKAGE = ROOT / "benchtrain"
# A room entry in architecture.md's "The rooms" block: its indent (four spaces, two more per level)
# and its folder name.
ROOM_ENTRY = re.compile(r"^(    (?:  )*)([a-z_]+)/(?=\s)")


def rooms_on_disk() -> set[str]:
    """Every Python package folder under benchtrain/ (a folder holding .py files), as `train/step`;
    folders of data alone (calibration/bundled, train/sample_data) are not rooms."""
    return {
        folder.relative_to(PACKAGE).as_posix()
        for folder in PACKAGE.rglob("*")
        if folder.is_dir() and folder.name != "__pycache__" and any(folder.glob("*.py"))
    }


def rooms_in_architecture(text: str) -> set[str]:
    """The folders the "The rooms" block names, nested by their indent (`train/` then `  step/`)."""
    block = text.split("## The rooms", 1)[1].split("\n\n", 2)[1]
    named: set[str] = set()
    parents: list[str] = []
    for line in block.splitlines():
        entry = ROOM_ENTRY.match(line)
        if entry is None:
            continue
        depth = (len(entry.group(1)) - 4) // 2
        parents = [*parents[:depth], entry.group(2)]
        named.add("/".join(parents))
    return named


def test_the_architecture_page_lists_every_package_and_no_other() -> None:
    on_disk, listed = rooms_on_disk(), rooms_in_architecture(ARCHITECTURE.read_text())
    assert on_disk, "no package folders found under benchtrain/"
    missing, extra = sorted(on_disk - listed), sorted(listed - on_disk)
    assert not missing and not extra, (
        f"docs/architecture.md's rooms disagree with benchtrain/: missing {missing}, not on disk {extra}"
    )


def test_the_rooms_check_reads_nesting_and_finds_a_missing_room() -> None:
    page = "## The rooms\n\n    common/    ground\n    train/     rooms:\n      step/    the step\n    x.py\n\nafter\n"
    assert rooms_in_architecture(page) == {"common", "train", "train/step"}


ROOM_NAMES = tuple(sorted({path.name for path in PACKAGE.iterdir() if path.is_dir() and any(path.glob("*.py"))}))
PYTHON_BLOCK = re.compile(r"```python\n(.*?)```", re.S)
IMPORT_LINE = re.compile(r"\s*(?:from\s+([\w.]+)\s+import\b|import\s+([\w.]+))")


def unprefixed_imports(text: str) -> list[str]:
    """Import lines in the python code blocks of `text` that name one of our rooms without `benchtrain.`."""
    found = []
    for block in PYTHON_BLOCK.findall(text):
        for line in block.splitlines():
            match = IMPORT_LINE.match(line)
            if match is not None and (match.group(1) or match.group(2)).split(".")[0] in ROOM_NAMES:
                found.append(line.strip())
    return found


def test_the_docs_import_our_modules_under_benchtrain() -> None:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    wrong = {page.name: lines for page in pages if (lines := unprefixed_imports(page.read_text()))}
    assert not wrong, f"import our modules as benchtrain.<room>: {wrong}"
    assert unprefixed_imports("```python\nfrom train.recipes.config import TrainConfig\nimport benchtrain\n```") == [
        "from train.recipes.config import TrainConfig"
    ]
