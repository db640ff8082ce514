"""The house's rules, read from the code (every import, those inside functions too): imports go
one way between the layers, no modules import each other in a loop; imports stand at the top of
a module (heavy libraries and the commands' handlers aside); what one room calls in another takes
and returns named types (no `Any`, no bare tuple); a plan is made in one place."""

from __future__ import annotations

import ast
from collections.abc import Collection
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("common", "calibration", "reports", "train", "bench", "trainer", "benchtrain")
PACKAGE = ROOT / "benchtrain"


def ours(name: str) -> str:
    """A module of ours by its name inside the one installed package (benchtrain.train.cli → train.cli);
    the rules below read the rooms by these names."""
    return name.removeprefix("benchtrain.")


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
    "train.launch_command": "train commands",
    "train.launch_slurm": "train commands",
    "train.package_wheel": "train commands",
    "bench": "bench",
    "bench.__main__": "bench commands",
    "bench.cli": "bench commands",
    # The package's front door (its public names, imported lazily) and the Trainer room behind it.
    "trainer": "benchtrain",
    "benchtrain": "benchtrain",
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
    # The public package a user's own Trainer imports (`from benchtrain import DeadlineCallback`): a
    # top floor over the rooms; nothing of ours imports it.
    "benchtrain": {"bench", *TRAIN_ROOMS, "reports", "calibration", "common"},
}


def layer_of(module: str) -> str | None:
    names = [prefix for prefix in LAYERS if module == prefix or module.startswith(prefix + ".")]
    return LAYERS[max(names, key=len)] if names else None


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts) or "benchtrain"


def our_modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def import_base(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The module a `from ... import` in `module` reads from, a relative one resolved."""
    base = node.module or ""
    if node.level:
        anchor = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
        base = ".".join([*anchor, base] if base else anchor)
    return ours(base)


def imported_modules(source: str, module: str, is_package: bool, known: set[str]) -> set[str]:
    """The modules of ours that `source` imports anywhere in it (a function's body included).
    `from a import b` names the module a.b where there is one, else a."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(ours(alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = import_base(node, module, is_package)
            for alias in node.names:
                joined = ours(f"{base}.{alias.name}")
                found.add(joined if joined in known else base)
    return {name for name in found if name.split(".")[0] in PACKAGES}


def import_graph() -> dict[str, set[str]]:
    modules = our_modules()
    known = set(modules)
    return {
        name: imported_modules(path.read_text(), name, path.name == "__init__.py", known) - {name}
        for name, path in modules.items()
    }


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


# -- imports at the top ----------------------------------------------------------------------------
# A module's first lines say what it depends on. An import inside a function hides that, so only
# two kinds stand there:
# - the commands' handlers import what they run inside them, so that `bench --help`, `train --help`
#   and `report --help` load no more than their parsers need (lm-evaluation-harness's pattern);
# - heavy or optional libraries, imported where they are used, so that what does not need them
#   (the calibration room, a plan from a calibration, every --help) does not pay for them, and an
#   optional extra that is not installed fails only the feature that needs it. Each with why (the
#   seconds are imports alone, measured on the 2-core CI machine).
# Moving every other import to the top found no import cycle: none needs to stay inside a function.
LAZY_COMMAND_MODULES = ("bench.cli", "train.cli", "train.compare_command", "reports.cli")
HEAVY_LIBRARIES = {
    "torch": "≈3 s; calibration/, every --help and a plan's arithmetic never touch it",
    "transformers": "≈1.5 s, and torch under it",
    "accelerate": "≈3 s: torch under it",
    "peft": "≈10 s: torch and transformers under it",
    "safetensors": "its torch half loads torch",
    "datasets": "≈1.5 s (pyarrow, pandas); reading records needs it, a plan from a profile does not",
    "pandas": "≈0.8 s; the reports' tables alone",
    "huggingface_hub": "≈0.4 s (its HTTP stack); hub references and pushes alone",
    "tqdm": "tqdm.auto loads asyncio (≈0.1 s) into every --help; progress bars alone",
    "optuna": "optional (`bench run --search optuna`)",
    "bitsandbytes": "optional (--quantize, 8-bit optimizers; CUDA builds)",
    "liger_kernel": "optional (--loss liger on CUDA)",
    "pynvml": "optional (NVIDIA's management library, on CUDA machines)",
}


def lazy_command_module(module: str) -> bool:
    return any(module == name or module.startswith(name + ".") for name in LAZY_COMMAND_MODULES)


def imports_inside_functions(source: str, module: str) -> list[str]:
    """`module:line imports NAME` for each import inside a function that the rule above does not allow."""
    if lazy_command_module(module):
        return []
    tree = ast.parse(source)
    found = []
    for function in ast.walk(tree):
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for statement in function.body:
            for node in ast.walk(statement):
                if isinstance(node, ast.Import):
                    names = [ours(alias.name) for alias in node.names]
                elif isinstance(node, ast.ImportFrom):
                    names = ["." * node.level + ours(node.module or "")]
                else:
                    continue
                found += [
                    f"{module}:{node.lineno} imports {name}"
                    for name in names
                    if name.split(".")[0] not in HEAVY_LIBRARIES
                ]
    return sorted(set(found))


def test_imports_stand_at_the_top() -> None:
    assert [
        found for name, path in our_modules().items() for found in imports_inside_functions(path.read_text(), name)
    ] == []


def test_the_top_rule_catches_an_import_inside_a_function() -> None:
    source = (
        "import json\n\n"
        "def plan():\n    import torch\n    from calibration.fit import fit\n    import math\n    return fit\n\n"
        "class Run:\n    def go(self):\n        if True:\n            from train.step import engine\n"
    )
    assert imports_inside_functions(source, "train.planning.fake") == [
        "train.planning.fake:12 imports train.step",
        "train.planning.fake:5 imports calibration.fit",
        "train.planning.fake:6 imports math",
    ]
    assert imports_inside_functions(source, "bench.cli") == []  # a command's handler
    assert imports_inside_functions(source, "train.cli") == []


def imports_of_test_files(source: str) -> list[str]:
    """The imports of a test file that name another test file (`test_…`) or the `tests` package
    (which a dependency's top-level `tests` package shadows): what two test files share lives in
    tests/helpers.py or tests/conftest.py, imported as `helpers`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found += [
            f"{node.lineno} imports {name}"
            for name in names
            if name.split(".")[0] == "tests" or name.split(".")[0].startswith("test_")
        ]
    return found


def test_no_test_file_imports_another() -> None:
    found = [
        f"{path.name}:{line}"
        for path in sorted((ROOT / "tests").glob("*.py"))
        for line in imports_of_test_files(path.read_text())
    ]
    assert found == []


def test_the_test_file_rule_catches_an_import_of_a_test_file() -> None:
    source = (
        "import json\nfrom helpers import run_main\n\n"
        "def test_x():\n    from test_cli import run_main\n    import test_planner\n    from tests.helpers import FIXTURE\n"
    )
    assert imports_of_test_files(source) == ["5 imports test_cli", "6 imports test_planner", "7 imports tests.helpers"]


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
    assert arrows_against_the_rule({"bench.cli": {"train.arguments"}, "train.cli": {"train.arguments"}}) == []
    assert arrows_against_the_rule({"train.step.engine": {"train.arguments"}}) == [
        "train.step.engine (train.step) imports train.arguments (command arguments)"
    ]


def test_the_rule_catches_a_loop() -> None:
    graph = {
        "train.planning.planner": {"train.step.evaluation", "common.errors"},
        "train.step.evaluation": {"train.planning.planner"},
        "common.errors": set(),
    }
    assert import_loops(graph) == [["train.planning.planner", "train.step.evaluation"]]
    assert import_loops({"a": {"b"}, "b": {"c"}, "c": set()}) == []


# The planning pipeline has one home: a plan is made (and communication priced for it) only in
# train/recipes/run_plan.py, whoever asks for it (a train command, each setup, each compared row).
PLANNING_CALLS = {"make_plan", "plan_communication"}
PLANNING_HOME = "train.recipes.run_plan"


def planning_calls_outside_home() -> list[str]:
    import ast

    found = []
    for module, path in our_modules().items():
        if module == PLANNING_HOME or layer_of(module) is None or module.startswith("train.planning"):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call):
                name = (
                    node.func.id
                    if isinstance(node.func, ast.Name)
                    else node.func.attr
                    if isinstance(node.func, ast.Attribute)
                    else None
                )
                if name in PLANNING_CALLS:
                    found.append(f"{module}:{node.lineno} calls {name}")
    return found


def test_plans_are_made_in_one_place() -> None:
    assert planning_calls_outside_home() == []


# -- what one room hands another: named types -------------------------------------------------
# A function called across rooms is one that a module of another room imports by name
# (`from X import f`, followed through re-exports such as calibration/__init__.py) or calls as
# `X.f` after `import X` / `from package import X`; a class imported so brings its public methods
# (`__init__` and properties included) and its public annotated fields (a dataclass's or a
# NamedTuple's constructor) along. None of their parameters or returns may be `Any` (a bare one or
# one inside, `dict[str, Any]` and `Callable[..., Any]` too) or a fixed-length tuple (`tuple[a, b]`,
# bare `tuple`, or an unannotated `return a, b`): a reader of the other room must see what it gets,
# by name, not `[0]`/`[1]`. `tuple[X, ...]` is a sequence and passes. A JSON object, whose values
# are whatever the file holds, is named once: common/json_types.py's JsonDict.
TUPLE_NAMES = {"tuple", "Tuple"}


def annotation_problems(annotation: ast.expr | None) -> list[str]:
    """What in one annotation may not cross rooms: `Any`, a fixed-length or bare tuple."""
    if annotation is None:
        return []
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        return annotation_problems(ast.parse(annotation.value, mode="eval").body)
    problems: list[str] = []
    for node in ast.walk(annotation):
        name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
        if name == "Any":
            problems.append("Any")
        elif isinstance(node, ast.Subscript) and isinstance(node.value, (ast.Name, ast.Attribute)):
            value = node.value.id if isinstance(node.value, ast.Name) else node.value.attr
            items = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
            if value in TUPLE_NAMES and not (
                len(items) == 2 and isinstance(items[1], ast.Constant) and items[1].value is Ellipsis
            ):
                problems.append("tuple")
    # A bare `tuple` (not subscripted) says nothing of what it holds.
    subscripted = {id(node.value) for node in ast.walk(annotation) if isinstance(node, ast.Subscript)}
    problems += [
        "tuple"
        for node in ast.walk(annotation)
        if isinstance(node, ast.Name) and node.id in TUPLE_NAMES and id(node) not in subscripted
    ]
    return sorted(set(problems))


def returns_a_tuple(function: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """An unannotated function returning a tuple display (its own returns, not a nested function's)."""
    pending: list[ast.AST] = list(function.body)
    while pending:
        node = pending.pop()
        if isinstance(node, ast.Return) and isinstance(node.value, ast.Tuple):
            return True
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            pending.extend(ast.iter_child_nodes(node))
    return False


def signature_problems(function: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    """`parameter: annotation` or `returns annotation` for each part of the signature that may not cross rooms."""
    arguments = function.args
    parameters = [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs]
    parameters += [argument for argument in (arguments.vararg, arguments.kwarg) if argument is not None]
    annotated = [(argument.arg, argument.annotation) for argument in parameters if argument.annotation is not None]
    found = [f"{name}: {ast.unparse(annotation)}" for name, annotation in annotated if annotation_problems(annotation)]
    if function.returns is not None and annotation_problems(function.returns):
        found.append(f"returns {ast.unparse(function.returns)}")
    elif function.returns is None and returns_a_tuple(function):
        found.append("returns a bare tuple (unannotated)")
    return found


def class_problems(cls: ast.ClassDef) -> list[tuple[str, str]]:
    """(member, problem) for the public methods and annotated fields of a class."""
    found = []
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and (
            not node.name.startswith("_") or node.name == "__init__"
        ):
            found += [(node.name, problem) for problem in signature_problems(node)]
        elif (
            isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and not node.target.id.startswith("_")
        ):
            found += (
                [(node.target.id, f"field {ast.unparse(node.annotation)}")]
                if annotation_problems(node.annotation)
                else []
            )
    return found


def top_level(
    tree: ast.Module, module: str, is_package: bool, known: set[str]
) -> tuple[dict[str, ast.AST], dict[str, tuple[str, str]]]:
    """A module's own functions and classes by name, and the names it imports from modules of ours
    (local name -> (module, name)), which is what a re-export is."""
    defined: dict[str, ast.AST] = {}
    imported: dict[str, tuple[str, str]] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined[node.name] = node
        elif isinstance(node, ast.ImportFrom):
            base = import_base(node, module, is_package)
            for alias in node.names:
                if base in known and ours(f"{base}.{alias.name}") not in known:
                    imported[alias.asname or alias.name] = (base, alias.name)
    return defined, imported


def names_used(tree: ast.Module, module: str, is_package: bool, known: set[str]) -> set[tuple[str, str]]:
    """(module, name) for each name of another module of ours that `tree` imports by name or reads
    as `module.name` (imports inside functions too)."""
    used: set[tuple[str, str]] = set()
    modules: dict[str, str] = {}  # a local name that stands for a module of ours
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                name = ours(alias.name)
                modules[alias.asname or alias.name.split(".")[0]] = name if alias.asname else alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            base = import_base(node, module, is_package)
            for alias in node.names:
                if ours(f"{base}.{alias.name}") in known:
                    modules[alias.asname or alias.name] = ours(f"{base}.{alias.name}")
                elif base in known:
                    used.add((base, alias.name))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            chain: list[str] = []
            inner: ast.expr = node
            while isinstance(inner, ast.Attribute):
                chain.insert(0, inner.attr)
                inner = inner.value
            if not isinstance(inner, ast.Name) or inner.id not in modules:
                continue
            target = modules[inner.id]
            while chain and f"{target}.{chain[0]}" in known:
                target = f"{target}.{chain.pop(0)}"
            if chain and target in known:
                used.add((target, chain[0]))
    return used


def untyped_crossings(sources: dict[str, str], packages: Collection[str] = ()) -> list[str]:
    """`module.function: problem` (`module.Class.member: problem`) for each function or class that
    a module of another room uses whose signature carries `Any` or a bare tuple. `sources` maps
    module names to their text; `packages` names those that are a package's __init__."""
    known = set(sources)
    trees = {name: ast.parse(text) for name, text in sources.items()}
    tops = {name: top_level(tree, name, name in packages, known) for name, tree in trees.items()}

    def definition(module: str, name: str, hops: int = 0) -> tuple[str, ast.AST] | None:
        defined, imported = tops[module]
        if name in defined:
            return module, defined[name]
        if name in imported and hops < 10:
            return definition(*imported[name], hops + 1)
        return None

    crossing: dict[tuple[str, str], ast.AST] = {}
    for user, tree in trees.items():
        for module, name in names_used(tree, user, user in packages, known):
            found = definition(module, name)
            if found is not None and layer_of(found[0]) != layer_of(user):
                crossing[(found[0], name)] = found[1]
    problems = []
    for (module, name), node in sorted(crossing.items()):
        if isinstance(node, ast.ClassDef):
            problems += [f"{module}.{name}.{member}: {problem}" for member, problem in class_problems(node)]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            problems += [f"{module}.{name}: {problem}" for problem in signature_problems(node)]
    return sorted(problems)


def our_sources() -> tuple[dict[str, str], set[str]]:
    modules = our_modules()
    return {name: path.read_text(encoding="utf-8") for name, path in modules.items()}, {
        name for name, path in modules.items() if path.name == "__init__.py"
    }


def test_no_any_or_bare_tuple_crosses_rooms() -> None:
    assert untyped_crossings(*our_sources()) == []


def test_the_crossing_rule_catches_any_and_tuples() -> None:
    planner = (
        "from typing import Any\n"
        "from common.json_types import JsonDict\n"
        "def widths(rows: list[dict[str, Any]]) -> tuple[float, float]: ...\n"
        "def names(rows: list[JsonDict]) -> tuple[str, ...]: ...\n"
        "def pair(x: int):\n    return x, x\n"
        "def alone(options: Any) -> tuple: ...\n"
        "class Plan:\n"
        "    layout: tuple[int, int]\n"
        "    steps: int\n"
        "    def __init__(self, settings: 'Any') -> None: ...\n"
        "    def clean(self) -> int: ...\n"
        "    def _private(self) -> Any: ...\n"
    )
    sources = {
        "common.json_types": "from typing import Any\nJsonDict = dict[str, Any]\n",
        "train.planning": "from train.planning.planner import widths\n",
        "train.planning.planner": planner,
        "train.recipes.recipe": (
            "from train.planning import widths\nfrom train.planning import planner\nfrom train.planning.planner import Plan\n"
            "planner.names([])\nplanner.pair(1)\n"
        ),
    }
    assert untyped_crossings(sources, {"train.planning"}) == [
        "train.planning.planner.Plan.__init__: settings: 'Any'",
        "train.planning.planner.Plan.layout: field tuple[int, int]",
        "train.planning.planner.pair: returns a bare tuple (unannotated)",
        "train.planning.planner.widths: returns tuple[float, float]",
        "train.planning.planner.widths: rows: list[dict[str, Any]]",
    ]
    # `alone` is used only inside its room; `import` of a whole module counts as `module.name` calls.
    sources["train.planning.fit"] = "from train.planning.planner import alone\n"
    sources["calibration.user"] = "import train.planning.planner\ntrain.planning.planner.alone(1)\n"
    assert "train.planning.planner.alone: options: Any" in untyped_crossings(sources, {"train.planning"})
    assert "train.planning.planner.alone: returns tuple" in untyped_crossings(sources, {"train.planning"})
