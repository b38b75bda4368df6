"""The docs name only things that exist (issue 22).

Every `make <target> [VAR=value ...]` in the code of README.md and docs/*.md (fenced blocks and inline code)
names a rule of the Makefile and variables it reads; every Hydra config a command line selects
(`experiment=`, `trainer=`, `model=`, `eval=`, `+runtime=`) is in this plugin's configs/ or the framework's;
every relative link reaches a file (and a heading, for `#anchors`); the README stays short and indexes docs/.
"""

import re
import shlex
from pathlib import Path

import pytest

from palu_trainer.framework.checkout import CONFIG_DIR, checkout_dir

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]
MAKEFILE = ROOT / "Makefile"
README_MAX_LINES = 120

FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"(`+)(.+?)\1", re.DOTALL)
SHELL_COMMENT = re.compile(r"(^|\s)#.*$")
MAKE_COMMAND = re.compile(r"(?:^|[;&|(]\s*)make\s+([^;&|()]*)")
ASSIGNMENT = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)=")
TARGET = re.compile(r"^[A-Za-z0-9][\w.-]*$")
OPTION = re.compile(r"(?<![\w.$+|-])([A-Z][A-Z0-9_]*)=")
CONFIG_CHOICE = re.compile(r"(?<![\w.+/-])\+?(experiment|trainer|model|eval|runtime)=([A-Za-z0-9_][\w./-]*)")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def code_snippets(path: Path) -> list[tuple[int, str]]:
    """(line number, code) for each line of a fenced block (shell comments dropped, backslash continuations
    joined) and each inline code span (which may wrap onto the next line of its paragraph)."""
    snippets, paragraph, in_block, pending = [], [], False, None

    def flush():
        if paragraph:
            first, text = paragraph[0][0], "\n".join(line for _, line in paragraph)
            for match in INLINE_CODE.finditer(text):
                line = first + text.count("\n", 0, match.start())
                snippets.append((line, match.group(2).replace("\n", " ")))
            paragraph.clear()

    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if FENCE.match(line):
            flush()
            in_block = not in_block
            continue
        if in_block:
            code = SHELL_COMMENT.sub("", line).rstrip()
            start, joined = pending or (number, "")
            joined = f"{joined} {code.removesuffix(chr(92)).strip()}".strip()
            if code.endswith("\\"):
                pending = (start, joined)
            else:
                snippets.append((start, joined))
                pending = None
        elif line.strip():
            paragraph.append((number, line))
        else:
            flush()
    flush()
    return snippets


def make_commands(code: str) -> list[tuple[list[str], list[str]]]:
    """(targets, variables) of each `make` command in a line of code; `[OPTION]` marks an optional part."""
    commands = []
    for match in MAKE_COMMAND.finditer(code):
        words = match.group(1).replace("[", " ").replace("]", " ")
        try:
            tokens = shlex.split(words)
        except ValueError:  # an unbalanced quote in prose: plain words
            tokens = words.split()
        targets, variables = [], []
        for token in tokens:
            if token.startswith("-"):
                continue
            if assignment := ASSIGNMENT.match(token):
                variables.append(assignment.group(1))
            elif TARGET.match(token):
                targets.append(token)
            else:
                break
        commands.append((targets, variables))
    return commands


def makefile_text() -> str:
    return MAKEFILE.read_text(encoding="utf-8").replace("\\\n", " ")


def makefile_targets() -> set[str]:
    """Rules (`name ...:` but not `:=`) and the .PHONY list."""
    targets = set()
    for line in makefile_text().splitlines():
        if line.startswith("\t") or line.lstrip().startswith("#"):
            continue
        rule = re.match(r"^([A-Za-z0-9.][\w.\- ]*?)\s*:(?!=)(.*)$", line)
        if rule and "=" not in rule.group(1):
            names = rule.group(1).split()
            targets.update(rule.group(2).split() if names == [".PHONY"] else names)
    return targets


def makefile_variables() -> set[str]:
    """Variables the Makefile defines, exports or reads: `VAR ?=`/`:=`/`=`/`+=`, `export VAR ...`,
    `$(VAR)`, `${VAR}`, and `$${VAR...}` (a command-line variable read by the recipe's shell)."""
    text = makefile_text()
    names = set(re.findall(r"^\s*(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)\s*(?:\?|:|\+)?=", text, re.MULTILINE))
    for exported in re.findall(r"^\s*export\s+([A-Za-z0-9_ \t]+)$", text, re.MULTILINE):
        names.update(exported.split())
    names.update(re.findall(r"\$[({]([A-Za-z_][A-Za-z0-9_]*)[)}]", text))
    names.update(re.findall(r"\$\$\{([A-Za-z_][A-Za-z0-9_]*)", text))
    return names


def environment_variables() -> set[str]:
    """Upper-case names the package's sources quote (`os.environ.get("TOFU_DIR")`, `"PALU_RUN_STATS"`)."""
    sources = (ROOT / "src").rglob("*.py")
    return {name for path in sources for name in re.findall(r"[\"']([A-Z][A-Z0-9_]+)[\"']", path.read_text())}


def github_anchors(path: Path) -> set[str]:
    """The `#anchors` GitHub gives a Markdown file's headings (outside code blocks)."""
    anchors, seen, in_block = set(), {}, False
    for line in path.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            in_block = not in_block
            continue
        heading = None if in_block else HEADING.match(line)
        if heading:
            slug = re.sub(r"[^\w\- ]", "", heading.group(2).lower()).replace(" ", "-")
            anchors.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
            seen[slug] = seen.get(slug, 0) + 1
    return anchors


def where(path: Path, line: int) -> str:
    return f"{path.relative_to(ROOT)}:{line}"


def test_the_readme_is_a_landing_page_of_at_most_120_lines():
    lines = len(README.read_text(encoding="utf-8").splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move sections to docs/ (at most 120)"


def test_the_readme_links_every_doc():
    readme = README.read_text(encoding="utf-8")
    unlinked = [doc.name for doc in DOCS[1:] if f"](docs/{doc.name})" not in readme]
    assert not unlinked, f"README.md's index does not link docs/{unlinked}"


def test_the_parsers_read_commands_and_the_makefile(tmp_path):
    block = '```bash\nmake demo METHODS="NPO PALU" \\\n  FAST=1   # comment make bogus\n```\n'
    inline = "Run `make gpu-check [CPU=1]` or `make tofu\nFORGET=05`, then `pip install x`.\n"
    path = tmp_path / "doc.md"
    path.write_text(block + "\n" + inline, encoding="utf-8")
    snippets = code_snippets(path)
    commands = [command for _, code in snippets for command in make_commands(code)]
    assert commands == [(["demo"], ["METHODS", "FAST"]), (["gpu-check"], ["CPU"]), (["tofu"], ["FORGET"])]
    assert [line for line, code in snippets if "make" in code] == [2, 6, 6]
    assert {"setup", "test", "demo", "tofu", "compare", "tofu-ablation"} <= makefile_targets()
    assert {"FORGET", "GPUS", "FAST", "METHODS", "TOFU_DIR", "MAX_JOBS", "VENV"} <= makefile_variables()
    assert "RECIPE" in makefile_variables() and "PALU" not in makefile_variables()


def test_every_make_target_and_option_in_the_docs_exists():
    targets, variables = makefile_targets(), makefile_variables()
    problems, seen = [], 0
    for doc in DOCS:
        for line, code in code_snippets(doc):
            for command_targets, command_variables in make_commands(code):
                seen += 1
                if not command_targets:
                    problems.append(f"{where(doc, line)}: `{code}` names no make target")
                problems += [
                    f"{where(doc, line)}: make target '{target}' is not a rule of the Makefile (`{code}`)"
                    for target in command_targets
                    if target not in targets
                ]
                problems += [
                    f"{where(doc, line)}: make option {variable}= is not a Makefile variable (`{code}`)"
                    for variable in command_variables
                    if variable not in variables
                ]
    assert seen > 20, f"only {seen} make commands found in the docs: is the parser broken?"
    assert not problems, "\n".join(problems)


def test_every_option_the_docs_name_is_read_by_the_makefile_or_the_code():
    """`RETAIN_LOGS=`, `PRESET=small`, `TOFU_DIR=/path` ...: a Makefile variable, or an environment variable
    that the package reads (HF_HUB_OFFLINE is huggingface_hub's)."""
    known = makefile_variables() | environment_variables() | {"HF_HUB_OFFLINE"}
    problems, seen = [], 0
    for doc in DOCS:
        snippets = code_snippets(doc)
        # a shell variable that a block sets and reads itself (docs/setup.md's own-environment block)
        text = "\n".join(code for _, code in snippets)
        own = {name for name in re.findall(r"^([A-Z_]+)=", text, re.M) if f"${name}" in text}
        for line, code in snippets:
            for name in OPTION.findall(code):
                seen += 1
                if name not in known | own:
                    problems.append(
                        f"{where(doc, line)}: option {name}= is read by neither the Makefile nor the code"
                    )
    assert seen > 20, f"only {seen} options found in the docs: is the parser broken?"
    assert not problems, "\n".join(problems)


def test_every_config_the_docs_select_exists():
    """`experiment=unlearn/tofu/palu`, `trainer=NPO`, `+runtime=cpu` ...: a file in this plugin's configs/ or,
    for the framework's own configs, in the open-unlearning checkout."""
    framework_configs = checkout_dir() / "configs"
    unresolved = []
    for doc in DOCS:
        for line, code in code_snippets(doc):
            for group, name in CONFIG_CHOICE.findall(code):
                relative = f"{group}/{name.rstrip('.')}.yaml"
                if not (CONFIG_DIR / relative).is_file():
                    unresolved.append((where(doc, line), relative))
    assert unresolved, "the docs select the framework's configs (experiment=unlearn/tofu/default...)"
    if not framework_configs.is_dir():
        pytest.skip(
            f"open-unlearning checkout not found at {checkout_dir()} (run make setup or set "
            f"OPEN_UNLEARNING_DIR): {len(unresolved)} config choices outside configs/ not checked"
        )
    missing = [
        f"{place}: {relative} is neither in configs/ nor in {framework_configs}"
        for place, relative in unresolved
        if not (framework_configs / relative).is_file()
    ]
    assert not missing, "\n".join(missing)


def test_every_relative_link_in_the_docs_resolves():
    problems = []
    for doc in DOCS:
        for number, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1):
            for target in LINK.findall(line):
                if re.match(r"^[a-z]+:", target):
                    continue
                file, _, anchor = target.partition("#")
                resolved = (doc.parent / file).resolve() if file else doc
                if not resolved.exists():
                    problems.append(f"{where(doc, number)}: link to {target}: no such file")
                elif anchor and resolved.suffix == ".md" and anchor not in github_anchors(resolved):
                    problems.append(f"{where(doc, number)}: link to {target}: no such heading")
    assert not problems, "\n".join(problems)
