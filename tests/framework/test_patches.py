"""The one place that patches (`framework/patches/`): what its patches rely on is still there on this stack
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
from palu_trainer.framework.patches.composition import composing_once

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
    patches_dir = WHEEL / "framework" / "patches"
    elsewhere = [
        line for path in modules if patches_dir not in path.parents for line in replaced_behaviour(path)
    ]
    assert elsewhere == []
    patched = [line for path in patches_dir.glob("*.py") for line in replaced_behaviour(path)]
    assert len(patched) >= 8  # the scan finds the patches


def test_the_run_gets_the_prechecks_composition_as_hydra_would_compose_it(monkeypatch):
    """palu-train composes the config once before Hydra's run: the run gets that object instead of
    composing again, and it is the config Hydra's own run composes (with the `hydra.mode=RUN` that the
    run adds), down to its `hydra` node; any other composition still composes."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra._internal.hydra import Hydra
    from hydra._internal.utils import compute_search_path_dir, create_config_search_path
    from hydra.core.global_hydra import GlobalHydra
    from hydra.types import RunMode
    from omegaconf import OmegaConf

    from palu_trainer.framework import cli

    monkeypatch.setattr(ConfigLoaderImpl, "load_configuration", ConfigLoaderImpl.load_configuration)
    monkeypatch.setattr(Hydra, "get_mode", Hydra.get_mode)
    configs = str(ensure_importable().parent / "configs")
    argv = ["--config-name=unlearn.yaml", "experiment=unlearn/tofu/palu", "trainer.args.learning_rate=3e-5"]
    composed, composed_by_the_run = cli.composed_run_config("train.yaml", Path(configs), argv)
    assert composed_by_the_run
    # the composition hydra.main makes for cli.main's job
    search_path = create_config_search_path(compute_search_path_dir(cli.__file__, None, configs))
    hydra = Hydra.create_main_hydra2(task_name="cli", config_search_path=search_path)
    overrides = [*argv[1:], "hydra.mode=RUN"]
    try:
        own = hydra.compose_config("unlearn.yaml", overrides, run_mode=RunMode.RUN)
        composing_once(composed)
        assert hydra.get_mode("unlearn.yaml", argv[1:]) is None  # the config leaves it unset
        reused = hydra.compose_config("unlearn.yaml", overrides, run_mode=RunMode.RUN)
        again = hydra.compose_config("unlearn.yaml", overrides, run_mode=RunMode.RUN)
    finally:
        GlobalHydra.instance().clear()
    assert reused is composed and again is not composed
    assert OmegaConf.to_yaml(reused) == OmegaConf.to_yaml(own) == OmegaConf.to_yaml(again)
    assert reused.trainer.args.learning_rate == 3e-5 and reused.hydra.mode == RunMode.RUN
