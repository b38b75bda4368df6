"""`make options-table`: docs/method.md's table of PALU's options, written from `PALUOptions` (each field's
default and help) between its markers; tests/method/test_options.py fails while the page differs."""

import sys
from pathlib import Path

from palu_trainer.options import PALUOptions

METHOD_DOC = Path(__file__).resolve().parents[1] / "docs" / "method.md"
BEGIN = "<!-- options-table: written by `make options-table` from PALUOptions -->\n"
END = "<!-- /options-table -->\n"


def with_table(page: str) -> str:
    """`page` with the text between its markers replaced by `PALUOptions.help_table()`."""
    head, rest = page.split(BEGIN)
    return head + BEGIN + PALUOptions.help_table() + END + rest.split(END, 1)[1]


if __name__ == "__main__":
    page = METHOD_DOC.read_text(encoding="utf-8")
    METHOD_DOC.write_text(with_table(page), encoding="utf-8")
    print(f"{METHOD_DOC}: {len(PALUOptions.model_fields)} options", file=sys.stderr)
