"""PALUOptions is the one list of PALU's options: the YAML's values, the docs' table and the usage text
follow it."""

import importlib.util
import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from palu_trainer.framework.cli import USAGE
from palu_trainer.options import PALUOptions

ROOT = Path(__file__).resolve().parents[2]


def written(value) -> str:
    """A default as docs/method.md writes it: booleans and words in backticks, numbers bare."""
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    return f"`{value}`" if isinstance(value, str) else str(value)


def test_palu_yaml_sets_every_option_to_its_default():
    method_args = OmegaConf.load(ROOT / "configs/trainer/PALU.yaml").method_args
    assert OmegaConf.to_container(method_args) == PALUOptions.defaults()


def test_the_docs_table_is_the_one_make_options_table_writes_with_a_row_per_option_at_its_default():
    spec = importlib.util.spec_from_file_location("options_table", ROOT / "scripts" / "options_table.py")
    options_table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(options_table)
    page = (ROOT / "docs" / "method.md").read_text(encoding="utf-8")
    assert options_table.with_table(page) == page, "docs/method.md's table is stale: make options-table"
    rows = PALUOptions.help_table().splitlines()[2:]
    documented = dict(re.match(r"\| `(\w+)` \| (.+?) \| ", row).groups() for row in rows)
    assert documented == {name: written(value) for name, value in PALUOptions.defaults().items()}
    help_of_top_k = PALUOptions.model_fields["top_k"].json_schema_extra["help"]
    assert help_of_top_k.replace("|", r"\|") in page  # the help, not the short meaning, is the row


def test_the_plugins_trainer_yamls_hold_values_only():
    """Their help is the options' (above); a comment would be a second one."""
    for path in sorted((ROOT / "configs" / "trainer").glob("*.yaml")):
        assert "#" not in path.read_text(), f"{path.name} holds a comment"


def test_usage_names_only_options_at_their_defaults():
    lines = [line for line in USAGE.splitlines() if "trainer.method_args." in line]
    shown = dict(re.findall(r"\.(\w+)=([\w.]+)", "\n".join(lines)))
    assert len(shown) >= 4
    defaults = PALUOptions.defaults()
    assert {name: str(defaults[name]) for name in shown} == shown


def test_every_option_has_help():
    assert all(len(each.description) > 10 for each in PALUOptions.model_fields.values())


@pytest.mark.parametrize(
    ("method_args", "message"),
    [
        ({"topk": 5}, r"^topk is not an option of PALUTrainer: did you mean top_k\? its options are alpha, "),
        ({"num_initiating_tokens": 2}, r"top-level `num_initiating_tokens=N`"),
        ({"top_k": 0}, r"^top_k=0: give a positive integer K"),
        ({"gamma": -1}, r"^gamma=-1: must be a number >= 0"),
        ({"reference_cache_max_gib": "lots"}, r"^reference_cache_max_gib='lots': must be a number >= 0"),
    ],
)
def test_parse_names_the_key_and_what_to_write(method_args, message):
    with pytest.raises(ValueError, match=message):
        PALUOptions.parse(method_args)


def test_options_are_checked_when_built_directly_too():
    with pytest.raises(
        ValueError, match="kl_direction='forward'; choose one of ref_to_policy, policy_to_ref"
    ):
        PALUOptions(kl_direction="forward")
    assert PALUOptions.parse({"kl_weight": "alpha"}).kl_weight == "alpha"
