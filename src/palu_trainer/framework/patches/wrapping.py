"""How the patches wrap the framework's loaders."""

import functools


def loader_wrapper(step):
    """`step(first, second, *options)` -> `wrapper(load, *options)`: the framework's `load` (`get_model` or
    `load_trainer`, each returning a pair), whose pair goes through `step`."""

    @functools.wraps(step)
    def wrapper(load, *options):
        @functools.wraps(load)
        def loaded(*args, **kwargs):
            return step(*load(*args, **kwargs), *options)

        return loaded

    return wrapper
