"""Option validators shared by every trainer of the plugin: a choice, a number in range, the loss weights.

Each returns the value it accepts and raises ValueError naming the option, the value and what is allowed.
"""


def check_choice(name: str, value, choices: tuple):
    """`value` of option `name`, one of `choices` (true/false written as YAML booleans)."""
    if not any(type(value) is type(choice) and value == choice for choice in choices):  # 1 is not true
        written = ", ".join(
            str(choice).lower() if isinstance(choice, bool) else str(choice) for choice in choices
        )
        raise ValueError(f"{name}={value!r}; choose one of {written}")
    return value


def check_number(name: str, value, meaning: str, minimum: float = 0.0, exclusive: bool = False):
    """`value` of option `name` as a number >= `minimum` (> with `exclusive`); text, bools and nan refused.

    The message names the option, what it weighs (`meaning`) and the allowed range: a negative loss
    weight turns descent into ascent (gamma=-1 ascends the forget terms, alpha=-1 the retain loss), and a
    string ("abc") would otherwise fail only at the first step, after the reference cache is built.
    """
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if not number or not (value > minimum if exclusive else value >= minimum):
        bound = f"> {minimum:g}" if exclusive else f">= {minimum:g}"
        raise ValueError(f"{name}={value!r}: must be a number {bound} ({meaning})")
    return value


# The loss weights every trainer of this plugin reads (GradDiff's gamma and alpha): option -> meaning.
LOSS_WEIGHTS = {
    "gamma": "the weight of the forget terms; a negative one ascends them",
    "alpha": "the weight of the retain loss; a negative one is gradient ascent on the retain set",
}


def check_loss_weights(options: dict) -> None:
    """Check the `LOSS_WEIGHTS` present in `options` (a trainer's method_args) before anything is built."""
    for name, meaning in LOSS_WEIGHTS.items():
        if name in options:
            check_number(name, options[name], meaning)
