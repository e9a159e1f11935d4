"""Gymnasium wrappers by name, for `Config.env_wrappers` and the launcher's --env_wrappers.

"FlattenObservation,FrameStackObservation(stack_size=4)" names wrappers of
`gymnasium.wrappers` with literal arguments; from Python, a sequence of such names or of
env -> env callables works too. They wrap each single env, the first innermost.
"""

from __future__ import annotations

import ast
import difflib
import functools
import inspect
from collections.abc import Callable, Sequence

import gymnasium as gym

# A wrapper of one env: a gymnasium wrapper's name with literal arguments
# ("FrameStackObservation(stack_size=4)"), or, from Python, any env -> env callable.
EnvWrapper = str | Callable[[gym.Env], gym.Env]


@functools.cache
def _wrapper_classes() -> dict[str, type]:
    """The wrappers of one env that gymnasium.wrappers names, by name (once: those whose
    extra is missing fail to import each time they are asked for)."""
    classes = {}
    for name in gym.wrappers.__all__:
        try:
            cls = getattr(gym.wrappers, name)
        except (ImportError, gym.error.DependencyNotInstalled):  # e.g. JaxToNumpy's jax extra
            continue
        if inspect.isclass(cls) and issubclass(cls, gym.Wrapper):
            classes[name] = cls
    return classes


# Wrappers that would undo what sebulba relies on.
_REFUSED_WRAPPERS = {
    "Autoreset": "the vector env around each env resets it (NEXT_STEP autoreset)",
}

_WRAPPERS_EXAMPLE = "'FlattenObservation,FrameStackObservation(stack_size=4)'"


def parse_wrappers(wrappers: str | Sequence[EnvWrapper]) -> tuple[EnvWrapper, ...]:
    """The wrappers of `wrappers`, checked: a comma-separated string of gymnasium wrapper
    names, each optionally called with literal arguments
    (`"FlattenObservation,FrameStackObservation(stack_size=4)"`), or a sequence of such
    names and env -> env callables. Names come back in one canonical spelling.

    ValueError naming `env_wrappers` and the entry: an unknown name (with the close ones),
    arguments that are not literals or do not fit the wrapper's signature.
    """
    if isinstance(wrappers, str):
        entries: list[EnvWrapper] = list(_split_wrappers(wrappers)) if wrappers.strip() else []
    else:
        try:
            entries = list(wrappers)
        except TypeError:
            raise ValueError(
                f"env_wrappers must be a string such as {_WRAPPERS_EXAMPLE} or a sequence of "
                f"wrapper names and callables, got {wrappers!r}") from None
    parsed: list[EnvWrapper] = []
    for entry in entries:
        if callable(entry):
            parsed.append(entry)
        elif isinstance(entry, str):
            specs = _split_wrappers(entry)
            if len(specs) != 1:
                raise ValueError(f"env_wrappers entry {entry!r} must name one wrapper, got "
                                 f"{len(specs)}")
            parsed.append(specs[0])
            wrapper_function(specs[0])  # checks the name and the arguments
        else:
            raise ValueError(f"env_wrappers entries must be wrapper names or callables, got "
                             f"{entry!r}")
    return tuple(parsed)


def _split_wrappers(text: str) -> tuple[str, ...]:
    """`"A, B(4)"` -> `("A", "B(4)")`: entries in their canonical spelling (ast.unparse)."""
    try:
        tree = ast.parse(f"({text},)", mode="eval").body
    except SyntaxError:
        tree = None
    if not isinstance(tree, ast.Tuple) or not all(
            isinstance(e, ast.Name) or (isinstance(e, ast.Call) and isinstance(e.func, ast.Name))
            for e in tree.elts):
        raise ValueError(
            f"env_wrappers {text!r} is not a comma-separated list of gymnasium wrapper names, "
            f"each optionally with literal arguments, such as {_WRAPPERS_EXAMPLE}")
    return tuple(ast.unparse(e) for e in tree.elts)


def wrapper_function(wrapper: EnvWrapper) -> Callable[[gym.Env], gym.Env]:
    """env -> wrapped env, for one entry of `parse_wrappers`."""
    if callable(wrapper):
        return wrapper
    node = ast.parse(wrapper, mode="eval").body
    name = node.id if isinstance(node, ast.Name) else node.func.id
    classes = _wrapper_classes()
    if name in _REFUSED_WRAPPERS:
        raise ValueError(f"env_wrappers: {name} cannot be used: {_REFUSED_WRAPPERS[name]}")
    if name not in classes:
        close = difflib.get_close_matches(name, list(classes), n=3)
        known = f"did you mean {' or '.join(close)}?" if close else \
            "the names are " + ", ".join(sorted(set(classes) - set(_REFUSED_WRAPPERS)))
        raise ValueError(f"env_wrappers: {name!r} is not a wrapper in gymnasium.wrappers; "
                         f"{known}")
    cls = classes[name]
    args, kwargs = [], {}
    if isinstance(node, ast.Call):
        try:
            args = [ast.literal_eval(a) for a in node.args]
            kwargs = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
            if any(k is None for k in kwargs):
                raise ValueError("**")
        except ValueError:
            raise ValueError(f"env_wrappers: the arguments of {wrapper!r} must be literals "
                             "(numbers, strings, tuples, lists, dicts, True/False/None)") from None
    signature = inspect.signature(cls)
    try:
        signature.bind(None, *args, **kwargs)
    except TypeError as e:
        # The parameters after the env, without annotations: what an entry may give.
        params = [p.replace(annotation=inspect.Parameter.empty)
                  for p in list(signature.parameters.values())[1:]]
        raise ValueError(f"env_wrappers: {wrapper!r} does not fit {name}"
                         f"{signature.replace(parameters=params)}: {e}") from None
    return functools.partial(_wrapped, cls, tuple(args), kwargs) if (args or kwargs) else cls


def _wrapped(cls: type, args: tuple, kwargs: dict, env: gym.Env) -> gym.Env:
    """`cls(env, *args, **kwargs)`: the env first, then the entry's own arguments
    (a partial of `cls` would put positional ones before the env)."""
    return cls(env, *args, **kwargs)
