"""The house's rules, read from the code (every import, those inside functions too): imports go
one way between the layers, no modules import each other in a loop; in bench/, train/ and
reports/ no function is longer than a screen or takes more than seven parameters, and no module
is longer than 450 lines; a plan is made in one place."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("common", "calibration", "reports", "train", "bench")

# Which layer a module stands in: the longest prefix that names it. train/ has rooms, each on its
# own floor: a room imports only the rooms below it. The commands stand on top: they alone write
# reports (the run's, the comparison's, the calibration's) after the work below them. Beside them,
# the argument groups that bench's and train's commands share (train/arguments.py).
TRAIN_ROOMS = ("train.workload", "train.step", "train.planning", "train.running", "train.export", "train.recipes")
LAYERS = {
    "common": "common",
    "calibration": "calibration",
    "reports": "reports",
    "train": "train",
    **{room: room for room in TRAIN_ROOMS},
    "train.arguments": "command arguments",
    "train.__main__": "train commands",
    "train.cli": "train commands",
    "train.compare_command": "train commands",
    "bench": "bench",
    "bench.__main__": "bench commands",
    "bench.cli": "bench commands",
    "bench.commands": "bench commands",
}
# What each layer may import besides itself.
MAY_IMPORT = {
    "common": set(),
    "calibration": {"common"},
    "reports": {"calibration", "common"},
    "train": set(),
    **{room: {*TRAIN_ROOMS[:floor], "calibration", "common"} for floor, room in enumerate(TRAIN_ROOMS)},
    "command arguments": {*TRAIN_ROOMS, "calibration", "common"},
    "train commands": {"command arguments", *TRAIN_ROOMS, "reports", "calibration", "common"},
    "bench": {*TRAIN_ROOMS, "calibration", "common"},
    "bench commands": {"bench", "command arguments", *TRAIN_ROOMS, "reports", "calibration", "common"},
}


def layer_of(module: str) -> str | None:
    names = [prefix for prefix in LAYERS if module == prefix or module.startswith(prefix + ".")]
    return LAYERS[max(names, key=len)] if names else None


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def our_modules() -> dict[str, Path]:
    return {module_name(path): path for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))}


def imported_modules(source: str, module: str, is_package: bool, known: set[str]) -> set[str]:
    """The modules of ours that `source` imports anywhere in it (a function's body included).
    `from a import b` names the module a.b where there is one, else a."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    return {name for name in found if name.split(".")[0] in PACKAGES}


def import_graph() -> dict[str, set[str]]:
    modules = our_modules()
    known = set(modules)
    return {name: imported_modules(path.read_text(), name, path.name == "__init__.py", known) - {name} for name, path in modules.items()}


def arrows_against_the_rule(graph: dict[str, set[str]]) -> list[str]:
    wrong = []
    for module, targets in sorted(graph.items()):
        layer = layer_of(module)
        for target in sorted(targets):
            other = layer_of(target)
            if other != layer and other not in MAY_IMPORT.get(layer or "", set()):
                wrong.append(f"{module} ({layer}) imports {target} ({other})")
    return wrong


def import_loops(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each loop once, as the modules on it (strongly connected components of two or more)."""
    index: dict[str, int] = {}
    lowest: dict[str, int] = {}
    stack: list[str] = []
    loops: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = lowest[module] = len(index)
        stack.append(module)
        for target in graph.get(module, ()):
            if target not in index:
                visit(target)
                lowest[module] = min(lowest[module], lowest[target])
            elif target in stack:
                lowest[module] = min(lowest[module], index[target])
        if lowest[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                loops.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return loops


def test_imports_go_one_way() -> None:
    assert arrows_against_the_rule(import_graph()) == []


def test_no_import_loops() -> None:
    assert import_loops(import_graph()) == []


def test_every_module_stands_in_a_layer() -> None:
    assert [module for module in our_modules() if layer_of(module) not in MAY_IMPORT] == []


MAX_FUNCTION_LINES = 80
SHORT_FUNCTION_PACKAGES = ("bench", "train", "reports")


def long_functions(source: str, module: str) -> list[str]:
    """`module.function (N lines)` for each function (a method, a nested one) over MAX_FUNCTION_LINES."""
    return [
        f"{module}.{node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for node in ast.walk(ast.parse(source))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]


def test_no_function_is_longer_than_a_screen() -> None:
    modules = our_modules()
    assert [long for name, path in modules.items() if name.split(".")[0] in SHORT_FUNCTION_PACKAGES for long in long_functions(path.read_text(), name)] == []


def test_the_length_rule_catches_a_long_function() -> None:
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    assert long_functions(f"def long():\n{body}", "train.fake") == [f"train.fake.long ({MAX_FUNCTION_LINES + 1} lines)"]
    assert long_functions(f"def short():\n{body[: body.rindex('    x')]}", "train.fake") == []


MAX_PARAMETERS = 7
MAX_MODULE_LINES = 450


def crowded_functions(source: str, module: str) -> list[str]:
    """`module.function (N parameters)` for each function over MAX_PARAMETERS: every positional
    and keyword-only parameter counts (self and cls do not), *args and **kwargs once each, so a
    settings object passed whole counts once."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            arguments = node.args
            named = [a for a in (*arguments.posonlyargs, *arguments.args) if a.arg not in ("self", "cls")]
            count = len(named) + len(arguments.kwonlyargs) + (arguments.vararg is not None) + (arguments.kwarg is not None)
            if count > MAX_PARAMETERS:
                found.append(f"{module}.{node.name} ({count} parameters)")
    return found


def test_no_function_takes_more_than_seven_parameters() -> None:
    ours = [(name, path) for name, path in our_modules().items() if name.split(".")[0] in SHORT_FUNCTION_PACKAGES]
    assert [crowded for name, path in ours for crowded in crowded_functions(path.read_text(), name)] == []


def test_the_parameter_rule_counts_every_kind_once() -> None:
    assert crowded_functions("def f(self, a, b, c, d, e, f, g): pass", "train.fake") == []
    assert crowded_functions("def f(a, b, c, d, e, f, *, g, h): pass", "train.fake") == ["train.fake.f (8 parameters)"]
    assert crowded_functions("def f(a, b, c, d, e, f, *args, **kwargs): pass", "train.fake") == ["train.fake.f (8 parameters)"]
    assert crowded_functions("class A:\n    def __init__(self, settings, hooks): pass", "train.fake") == []


def test_no_module_is_longer_than_450_lines() -> None:
    lengths = {name: len(path.read_text().splitlines()) for name, path in our_modules().items() if name.split(".")[0] in SHORT_FUNCTION_PACKAGES}
    assert [f"{name} ({lines} lines)" for name, lines in lengths.items() if lines > MAX_MODULE_LINES] == []


def test_every_package_is_installed() -> None:
    """A fresh `pip install .` carries every package of ours (setuptools lists them by name)."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    packages = {name for name, path in our_modules().items() if path.name == "__init__.py"}
    assert packages - listed == set()


def test_the_rule_catches_an_import_inside_a_function() -> None:
    source = "import json\n\ndef plan():\n    from train.planning.planner import make_plan\n    from reports import figures\n    return make_plan\n"
    known = {"train.planning.planner", "reports.figures", "reports"}
    imports = imported_modules(source, "calibration.fake", False, known)
    assert imports == {"train.planning.planner", "reports.figures"}
    assert arrows_against_the_rule({"calibration.fake": imports}) == [
        "calibration.fake (calibration) imports reports.figures (reports)",
        "calibration.fake (calibration) imports train.planning.planner (train.planning)",
    ]
    assert arrows_against_the_rule({"train.recipes.recipe": {"reports.run_report"}}) == [
        "train.recipes.recipe (train.recipes) imports reports.run_report (reports)"
    ]
    assert arrows_against_the_rule({"train.workload.method": {"train.step.runtime"}}) == [
        "train.workload.method (train.workload) imports train.step.runtime (train.step)"
    ]
    assert arrows_against_the_rule({"train.running.loop": {"train.planning.planner", "train.workload.batching"}}) == []
    assert arrows_against_the_rule({"train.cli": {"reports.run_report", "train.recipes.recipe"}}) == []
    # The shared argument groups serve the commands; no component builds a parser from them.
    assert arrows_against_the_rule({"bench.commands.run": {"train.arguments"}, "train.cli": {"train.arguments"}}) == []
    assert arrows_against_the_rule({"train.step.engine": {"train.arguments"}}) == ["train.step.engine (train.step) imports train.arguments (command arguments)"]


def test_the_rule_catches_a_loop() -> None:
    graph = {"train.planning.planner": {"train.step.evaluation", "common.errors"}, "train.step.evaluation": {"train.planning.planner"}, "common.errors": set()}
    assert import_loops(graph) == [["train.planning.planner", "train.step.evaluation"]]
    assert import_loops({"a": {"b"}, "b": {"c"}, "c": set()}) == []


# The planning pipeline has one home: a plan is made (and communication priced for it) only in
# train/recipes/plan_setup.py, whoever asks for it (a train command, each setup, each compared row).
PLANNING_CALLS = {"make_plan", "plan_communication"}
PLANNING_HOME = "train.recipes.plan_setup"


def planning_calls_outside_home() -> list[str]:
    import ast

    found = []
    for module, path in our_modules().items():
        if module == PLANNING_HOME or layer_of(module) is None or module.startswith("train.planning"):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call):
                name = node.func.id if isinstance(node.func, ast.Name) else node.func.attr if isinstance(node.func, ast.Attribute) else None
                if name in PLANNING_CALLS:
                    found.append(f"{module}:{node.lineno} calls {name}")
    return found


def test_plans_are_made_in_one_place() -> None:
    assert planning_calls_outside_home() == []
