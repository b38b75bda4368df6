"""The one place that patches (`framework/patches.py`): what its patches rely on is still there on this stack
(the suite runs on each tested one), and no other module of the plugin replaces a method or loader."""

import ast
import importlib
import inspect
from pathlib import Path

import pytest
import transformers

import palu_trainer
from palu_trainer.framework import patches
from palu_trainer.framework.checkout import ensure_importable

WHEEL = Path(palu_trainer.__file__).parent


def resolve(target: str):
    """`target` (a dotted path: a module, then attributes) imported."""
    parts = target.split(".")
    for split in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for name in parts[split:]:
            found = getattr(found, name)
        return found
    raise ImportError(target)


def parameter_names(function) -> tuple[str, ...]:
    """`function`'s parameters, through a decorator that hides them behind (*args, **kwargs) without
    functools.wraps (DeepSpeed's `instrument_w_nvtx`): the function it closes over."""
    names = tuple(inspect.signature(function).parameters)
    if names == ("args", "kwargs"):
        inner = [cell.cell_contents for cell in function.__closure__ or () if callable(cell.cell_contents)]
        return parameter_names(inner[0]) if inner else names
    return names


@pytest.mark.parametrize("target, parameters", patches.INTERFACES, ids=[t for t, _ in patches.INTERFACES])
def test_every_patched_interface_is_there_with_the_parameters_the_patch_relies_on(target, parameters):
    ensure_importable()
    found = resolve(target)
    if parameters is None:
        assert isinstance(found, dict)
        return
    assert parameter_names(found)[: len(parameters)] == parameters


def test_a_changed_interface_fails_the_check():
    """The check above can fail: a parameter renamed, as a library release might."""
    renamed = inspect.signature(lambda self, out_dir, _internal_call: None).parameters
    listed = dict(patches.INTERFACES)["transformers.Trainer.save_model"]
    assert tuple(renamed) != listed
    assert tuple(inspect.signature(transformers.Trainer.save_model).parameters)[:3] == listed


def replaced_behaviour(path: Path) -> list[str]:
    """Assignments in `path` to an attribute named like something `patches.INTERFACES` lists or a method of
    the Trainer (`x.training_step = ...`, `setattr(module, "get_model", ...)`): a method or loader replaced at
    run time."""
    names = {target.rsplit(".", 1)[-1] for target, _ in patches.INTERFACES}
    names |= {name for name, _ in inspect.getmembers(transformers.Trainer, inspect.isfunction)}
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        targets = node.targets if isinstance(node, ast.Assign) else []
        attributes = [target.attr for target in targets if isinstance(target, ast.Attribute)]
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr" and len(node.args) > 1:
            attributes.append(getattr(node.args[1], "value", None))
        found += [f"{path.relative_to(WHEEL)}:{node.lineno} {name}" for name in attributes if name in names]
    return found


def test_no_module_but_patches_replaces_a_method_or_a_loader():
    modules = sorted(WHEEL.rglob("*.py"))
    elsewhere = [line for path in modules if path.name != "patches.py" for line in replaced_behaviour(path)]
    assert elsewhere == []
    assert len(replaced_behaviour(WHEEL / "framework" / "patches.py")) >= 8  # the scan finds its patches
