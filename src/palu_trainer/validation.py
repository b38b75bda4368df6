"""The plugin's one validation system (docs/layout.md): each group of options is a pydantic model whose
fields carry their range and meaning; `Options.parse` turns the first problem into one sentence naming the
option, the value and what to write instead. Strict: `1` is not `true`, `"0.1"` is not a number, and NaN or
infinity is no loss weight."""

import difflib
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Self

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, ValidationInfo


def did_you_mean(value, choices) -> str:
    """'did you mean X? ' for the choice nearest to a misspelt `value`, or ''."""
    close = difflib.get_close_matches(str(value), [str(choice) for choice in choices], n=1)
    return f"did you mean {close[0]}? " if close else ""


def written(value) -> str:
    """A value as a config writes it: booleans in YAML's lower case, floats without a trailing `.0`."""
    if value is None or isinstance(value, bool):
        return "null" if value is None else str(value).lower()
    return f"{value:g}" if isinstance(value, float) else str(value)


def described(meaning: str, help: str | None, **bounds) -> Any:
    """A field's `meaning` (the few words its messages end with) and `help` (its row of the docs' table)."""
    return Field(description=meaning, json_schema_extra={"help": help} if help else None, **bounds)


def Number(meaning: str, optional: bool = False, help: str | None = None, **bounds) -> Any:
    """A number (int or float, not bool) within `bounds` (pydantic's ge, gt, le, lt); `optional`: or null."""
    return Annotated[float | None if optional else float, described(meaning, help, **bounds)]


def Integer(meaning: str, optional: bool = False, help: str | None = None, **bounds) -> Any:
    return Annotated[int | None if optional else int, described(meaning, help, **bounds)]


def Choice(meaning: str, *choices, help: str | None = None) -> Any:
    """One of `choices`, each compared with its type: 1 is not true, and "true" is not true either."""

    names = [written(choice) for choice in choices]

    def check(value, info: ValidationInfo):
        if not any(type(value) is type(choice) and value == choice for choice in choices):
            raise ValueError(
                f"{info.field_name}={value!r}; {did_you_mean(value, names)}choose one of {', '.join(names)}"
            )
        return value

    return Annotated[Any, AfterValidator(check), described(meaning, help)]


def Checked(meaning: str, check, help: str | None = None) -> Any:
    """A value that `check(value)` accepts; it raises ValueError whose text follows `name=value: `."""

    def validate(value, info: ValidationInfo):
        try:
            return check(value)
        except ValueError as error:
            raise ValueError(f"{info.field_name}={value!r}: {error}") from None

    return Annotated[Any, AfterValidator(validate), described(meaning, help)]


BOUNDS = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}


class Options(BaseModel):
    """A group of options: subclasses declare fields with `Number`, `Integer`, `Choice` or `Checked`."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)
    OWNER: ClassVar[str] = "this trainer"  # "… is not an option of OWNER"
    # Options that moved elsewhere: the message says where.
    MOVED: ClassVar[Mapping[str, str]] = {}
    # The names that an unknown key's message lists, where not every field (a stock trainer's keywords).
    LISTED: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def defaults(cls) -> dict:
        return {name: info.default for name, info in cls.model_fields.items() if not info.is_required()}

    @classmethod
    def help_table(cls) -> str:
        """The options as a Markdown table: each key, its default (words and booleans as code), its help (else
        its meaning)."""
        rows = ["| key (`trainer.method_args.`) | default | meaning |", "| --- | --- | --- |"]
        for name, info in cls.model_fields.items():
            number = isinstance(info.default, int | float) and not isinstance(info.default, bool)
            default = str(info.default) if number else f"`{written(info.default)}`"
            text = ((info.json_schema_extra or {}).get("help") or info.description).replace("|", r"\|")
            rows.append(f"| `{name}` | {default} | {text} |")
        return "\n".join(rows) + "\n"

    @classmethod
    def parse(cls, values: Mapping, prefix: str = "") -> Self:
        """The options of `values` (absent ones at their defaults), or a ValueError naming the first bad key
        or value (`prefix`: where the group sits in the config, e.g. `trainer.args.`)."""
        for key in values:
            if key in cls.MOVED:
                raise ValueError(cls.MOVED[key])
        try:
            return cls.model_validate(dict(values))
        except ValidationError as error:
            first = min(error.errors(), key=lambda each: each["type"] != "extra_forbidden")  # a typo first
            raise ValueError(prefix + cls.message(first)) from None

    @classmethod
    def problem(cls, values: Mapping, prefix: str = "") -> str | None:
        """`parse`'s message for `values`, or None: a config check."""
        try:
            cls.parse(values, prefix)
        except ValueError as error:
            return str(error)
        return None

    @classmethod
    def take(cls, arguments: dict) -> Self:
        """`parse` of this group's keys, taken out of a constructor's keyword `arguments` (the rest stay)."""
        return cls.parse(
            {name: arguments.pop(name) for name in (*cls.model_fields, *cls.MOVED) if name in arguments}
        )

    @classmethod
    def message(cls, error: dict) -> str:
        if error["type"] == "value_error":
            return str(error["ctx"]["error"])
        name = str(error["loc"][0])
        if error["type"] == "extra_forbidden":
            listed = cls.LISTED or sorted(cls.model_fields)
            return (
                f"{name} is not an option of {cls.OWNER}: {did_you_mean(name, listed)}its options are "
                f"{', '.join(listed)}"
            )
        # A number of the wrong type or out of range: its whole range, read off the field's constraints.
        info = cls.model_fields[name]
        kind = "an integer" if info.annotation in (int, int | None) else "a number"
        bounds = " and ".join(
            f"{symbol} {written(getattr(bound, key))}"
            for bound in info.metadata
            for key, symbol in BOUNDS.items()
            if hasattr(bound, key)
        )
        return f"{name}={error['input']!r}: {f'must be {kind} {bounds}'.rstrip()} ({info.description})"


# The loss weights every trainer of this plugin reads (GradDiff's gamma and alpha).
Gamma = Number("the weight of the forget terms; a negative one ascends them", ge=0)
Alpha = Number("the weight of the retain loss; a negative one is gradient ascent on the retain set", ge=0)
