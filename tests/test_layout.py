"""The packages' floors: no import cycle, each layer imports only the layers below it; the lab (palu_lab) sits
on top of the plugin (palu_trainer), which never imports it."""

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

import palu_lab
import palu_trainer

PACKAGE_DIR = Path(palu_trainer.__file__).parent
LAB_DIR = Path(palu_lab.__file__).parent
# Each layer may import itself and the layers listed for it; `experiments` sits on top of the plugin, and the
# lab on top of everything.
ALLOWED = {
    "validation": {"validation"},
    "method": {"method", "validation"},
    "options": {"options", "method", "validation"},
    "spans": {"spans"},
    "benchmarks": {"benchmarks", "spans"},
    "training": {"training", "method", "validation"},
    "framework": {"framework", "training", "options", "method", "validation", "spans", "benchmarks"},
    "experiments": {
        *("experiments", "framework", "training", "options", "method", "validation", "spans", "benchmarks")
    },
}
ALLOWED["lab"] = set(ALLOWED) | {"lab"}
FRAMEWORK_MODULES = ("trainer", "data", "evals", "train", "model")
# Scripts that other modules must not import: what they share is in palu_lab.miniature,
# experiments.benchmark_facts and experiments.ablation_axes.
SCRIPTS = (
    "palu_lab.demo",
    "palu_lab.ablation",
    "palu_lab.convergence",
)


def module_name(path: Path) -> str:
    root = LAB_DIR if path.is_relative_to(LAB_DIR) else PACKAGE_DIR
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer(module: str) -> str | None:
    if module.split(".")[0] == "palu_lab":
        return "lab"
    return module.split(".")[1] if module.count(".") else None


def package_imports() -> dict[str, set[str]]:
    """Every palu_trainer and palu_lab module -> the modules of both it imports anywhere (functions
    included)."""
    paths = [*PACKAGE_DIR.rglob("*.py"), *LAB_DIR.rglob("*.py")]
    modules = {module_name(path): path for path in paths}
    graph = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                for alias in node.names:
                    child = f"{node.module}.{alias.name}"
                    targets.add(child if child in modules else node.module)
        graph[name] = {target for target in targets if target in modules and target != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == "open":
                return stack[stack.index(target) :] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_import_graph_is_read_from_the_sources():
    graph = package_imports()
    assert "palu_trainer.framework.checkout" in graph["palu_trainer.framework.datasets"]
    assert "palu_trainer.experiments.report" in graph["palu_trainer.experiments.recipe"]
    assert "palu_lab.miniature" in graph["palu_lab.demo"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_no_import_cycle_in_the_package():
    assert find_cycle(package_imports()) is None


def test_each_layer_imports_only_the_layers_below():
    offences = []
    for module, targets in package_imports().items():
        if layer(module) not in ALLOWED:
            continue
        for target in targets:
            if layer(target) not in ALLOWED[layer(module)]:
                offences.append(f"{module} -> {target}")
    assert offences == []


def test_no_module_imports_a_script():
    offences = [
        f"{module} -> {target}"
        for module, targets in package_imports().items()
        for target in targets
        if target in SCRIPTS
    ]
    assert offences == []


@pytest.mark.parametrize(
    ("floor", "expected"),
    [
        ("method", {"palu_trainer.method.objective", "palu_trainer.method.reference"}),
        ("training", {"palu_trainer.training.resume", "palu_trainer.training.run_plan"}),
    ],
)
def test_method_and_training_import_without_open_unlearning(floor, expected):
    """A fresh interpreter, no checkout to be found: the method and training layers load no framework module
    (nor Hydra: `training` is what touches transformers and torch alone)."""
    paths = (PACKAGE_DIR / floor).glob("*.py")
    modules = sorted(module_name(path) for path in paths if path.stem != "__init__")
    assert expected <= set(modules)
    script = (
        "import importlib, sys\n"
        f"for name in {modules!r}: importlib.import_module(name)\n"
        f"loaded = sorted(m for m in {(*FRAMEWORK_MODULES, 'hydra', 'omegaconf')!r} if m in sys.modules)\n"
        "assert not any('open-unlearning' in entry for entry in sys.path), sys.path\n"
        "print('framework modules loaded:', loaded)\n"
    )
    environment = {**os.environ, "OPEN_UNLEARNING_DIR": "/nonexistent/open-unlearning"}
    result = subprocess.run([sys.executable, "-c", script], env=environment, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "framework modules loaded: []" in result.stdout


def test_method_modules_stay_small():
    """The method layer is split by job (issue 31): no module over 400 lines."""
    lengths = {
        path.name: len(path.read_text().splitlines()) for path in (PACKAGE_DIR / "method").glob("*.py")
    }
    assert len(lengths) >= 10
    assert {name: length for name, length in lengths.items() if length > 400} == {}


def python_lines(folder: Path) -> int:
    return sum(len(path.read_text().splitlines()) for path in folder.rglob("*.py"))


def test_the_method_and_compute_loss_stay_small_and_each_floors_size_is_printed():
    """The method (`method/`) within 1,300 lines and `PALUTrainer.compute_loss` within 20, as `wc -l` counts
    them; every floor's lines printed for docs/layout.md. The rest is held by the limits per function and
    module below."""
    import inspect

    from palu_trainer.framework.trainers.palu import PALUTrainer

    floors = {
        name: python_lines(PACKAGE_DIR / name) if (PACKAGE_DIR / name).is_dir() else python_lines_of(name)
        for name in ("validation.py", "method", "options.py", "spans", "benchmarks", "training", "framework")
        + ("experiments",)
    }
    compute_loss = len(inspect.getsource(PALUTrainer.compute_loss).splitlines())
    print(floors, "compute_loss", compute_loss)
    assert floors["method"] <= 1300 and compute_loss <= 20


def python_lines_of(module: str) -> int:
    return len((PACKAGE_DIR / module).read_text().splitlines())


FUNCTION_LINES, MODULE_LINES = 60, 400


def wheel_modules() -> dict[str, Path]:
    paths = [*PACKAGE_DIR.rglob("*.py"), *(PACKAGE_DIR.parent / "hydra_plugins").rglob("*.py")]
    return {path.relative_to(PACKAGE_DIR).as_posix() if path.is_relative_to(PACKAGE_DIR) else path.name: path
            for path in paths}  # fmt: skip


def sizes(modules: dict[str, Path]) -> tuple[dict[str, int], dict[str, int]]:
    """(lines of each function, `module:name:line`, decorators counted with it; lines of each module)."""
    functions, lines = {}, {}
    for name, path in modules.items():
        text = path.read_text()
        lines[name] = len(text.splitlines())
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                start = min([decorator.lineno for decorator in node.decorator_list] + [node.lineno])
                functions[f"{name}:{node.name}:{start}"] = node.end_lineno - start + 1
    return functions, lines


def over_the_limits(modules: dict[str, Path]) -> dict[str, int]:
    """The functions over FUNCTION_LINES and the modules over MODULE_LINES."""
    functions, lines = sizes(modules)
    long_functions = {name: count for name, count in functions.items() if count > FUNCTION_LINES}
    long_modules = {name: count for name, count in lines.items() if count > MODULE_LINES}
    return long_functions | long_modules


def test_no_function_of_the_wheel_is_over_60_lines_and_no_module_over_400():
    """A function a reader can hold on a screen, a module with one job; the longest of each is printed."""
    functions, lines = sizes(wheel_modules())
    longest = max(functions, key=functions.get)
    print(f"longest function {longest} ({functions[longest]} lines)")
    print("longest modules", sorted(lines.items(), key=lambda item: -item[1])[:3])
    assert over_the_limits(wheel_modules()) == {}


def test_the_size_limits_catch_a_long_function_and_a_grown_module(tmp_path):
    """The check above can fail: a function of 61 lines, and a module to split that grew by a line."""
    long = tmp_path / "long.py"
    long.write_text("@decorated\ndef long():\n" + "".join(f"    x{i} = {i}\n" for i in range(59)))
    assert over_the_limits({"long.py": long}) == {"long.py:long:1": 61}
    grown = tmp_path / "grown.py"
    grown.write_text("x = 1\n" * (MODULE_LINES + 1))
    assert over_the_limits({"grown.py": grown}) == {"grown.py": 401}
