"""`palu-recipe kit DIR`: PALU's and TPO's folders in open-unlearning's contribution format, whose results are
docs/results.md's measured table told on its own (package data); tests/test_wheel.py runs a kit made from the
installed wheel."""

import re
import subprocess
import sys

import pytest

from palu_trainer.experiments.kit import contributions, measured_results, write_kit
from palu_trainer.framework.checkout import PROJECT_ROOT, checkout_dir


@pytest.fixture
def framework_copy(tmp_path):
    """A checkout to write into and run in: the framework's src/ and configs/ linked, its own saves/."""
    copy = tmp_path / "open-unlearning"
    copy.mkdir()
    for part in ("src", "configs"):
        (copy / part).symlink_to(checkout_dir() / part)
    return copy


def test_the_kit_has_the_frameworks_sections_and_the_measured_table(framework_copy):
    written = write_kit(framework_copy)
    assert [path.relative_to(framework_copy).as_posix() for path in written] == [
        f"community/methods/{name}/{file}" for name in ("PALU", "TPO") for file in ("README.md", "run.sh")
    ]
    results = measured_results()
    table = [line for line in results.splitlines() if line.startswith("|")]
    results_rows = set((PROJECT_ROOT / "docs" / "results.md").read_text().splitlines())
    assert len(table) == 11 and all(row in results_rows for row in table)  # docs/results.md's measured table
    # told on its own: no reference to the rest of that page, every row explained
    assert not re.search(r"\b(below|above)\b|short-budget|plot|\]\(", results), results
    assert all(f"{name} is " in results for name in ("PALU_cgrad", "PALU_release"))
    for contribution in contributions():
        readme = (framework_copy / "community" / "methods" / contribution.name / "README.md").read_text()
        assert re.findall(r"^# (\w+)", readme, re.M) == [contribution.name, "Setup", "Results", "Citation"]
        assert contribution.authors in readme and all(link in readme for link in contribution.links)
        assert "ships as a pip-installable plugin" in readme and results in readme
        assert "| PALU | lr 3e-5, λ 2, epoch 2 | 1 |" in readme and "SmolLM2-135M-Instruct" in readme
        assert "--render` at commit 6bd1572" in readme and "](docs/" not in readme
        script = (framework_copy / "community" / "methods" / contribution.name / "run.sh").read_text()
        assert (
            "# Hyper parameter tuning" in script.replace("#" * 10, "") or "Hyper parameter tuning" in script
        )
        assert "Final best parameters" in script and "python src/train.py" in script
        assert "python src/eval.py" in script and f"experiment={contribution.experiment}" in script
        assert subprocess.run(["bash", "-n", "-c", script]).returncode == 0
    learning_rates = re.search(r"lrs=\(\$\{LRS:-(.*)\}\)", script).group(1)
    assert learning_rates == "1e-5 2e-5 5e-5"  # the paper's grid, also for TPO


def test_the_kit_refuses_a_folder_that_is_not_a_framework_checkout(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "palu_trainer.experiments.recipe", "kit", str(tmp_path)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert result.returncode == 1
    assert (
        f"palu-recipe kit: {tmp_path} is not an open-unlearning checkout (no src/train.py)" in result.stderr
    )
