"""Reading a config file or text someone else wrote, within fixed bounds (issue 38).

A trainer config is read before anything is built, so a hostile one must fail fast and in one
line: regular files only (a FIFO would block, ``/dev/zero`` never ends), at most
:data:`MAX_BYTES`, nesting at most :data:`MAX_DEPTH` deep, YAML through a loader that counts
aliases and depth while composing, and every result walked once, without recursion, against
:data:`MAX_VALUES` (an alias bomb is small in memory but huge once anything iterates it).
Shared by :mod:`memsave_nb.trainers` and the CLI's ``--from-config``.
"""

from __future__ import annotations

import json
import os
import stat
from typing import Any, Mapping

from memsave_nb.checkpointing import PlanError, show
from memsave_nb.errors import quoted

__all__ = [
    "MAX_BYTES",
    "MAX_DEPTH",
    "MAX_VALUES",
    "MAX_ALIASES",
    "TrainerConfigError",
    "read_file",
    "parse_text",
    "check_bounds",
]

MAX_BYTES = 1 << 20  # a trainer config is a few KB; 1 MiB parses in well under a second
MAX_DEPTH = 32
MAX_VALUES = 100_000  # values reached by walking the result (aliases counted each time they are reached)
MAX_ALIASES = 100
MAX_DIGITS = 100  # a whole number in a trainer config; Python refuses to read one over 4300 digits


class _LongNumber:
    """A whole number of more than ``MAX_DIGITS`` digits, kept unread so the walk can name its field."""

    def __init__(self, digits: int) -> None:
        self.digits = digits


def _whole_number(text: str) -> Any:
    digits = sum(c.isdigit() for c in text)
    return _LongNumber(digits) if digits > MAX_DIGITS else int(text)


class TrainerConfigError(PlanError):
    """A trainer config that cannot be read (bad file, bad type, conflicting fields)."""


def read_file(path: Any) -> dict[str, Any]:
    """The object of fields in the JSON or YAML file ``path``: a regular file of at most ``MAX_BYTES``."""
    name = show(os.fspath(path) if isinstance(path, (str, os.PathLike)) else path)
    if not isinstance(path, (str, os.PathLike)):
        raise TrainerConfigError(f"a config path must be a string, got {name}")
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):  # follows links: a link to /dev/zero is a device
            raise TrainerConfigError(f"config {name} is not a regular file (a FIFO or a device is never read)")
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # replaced by a FIFO since the stat: no block
    except OSError as exc:
        raise TrainerConfigError(f"cannot read trainer config {name}: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise TrainerConfigError(f"config {name} is not a regular file (a FIFO or a device is never read)")
        data = f.read(MAX_BYTES + 1)
    if len(data) > MAX_BYTES:
        raise TrainerConfigError(f"config {name} is over {MAX_BYTES} bytes: not a trainer config")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise TrainerConfigError(f"config {name} is not UTF-8 text") from None
    return parse_text(text, name)


def parse_text(text: str, where: str = "text") -> dict[str, Any]:
    """JSON, else YAML, ``text`` -> its object of fields, within the bounds."""
    if len(text) > MAX_BYTES:
        raise TrainerConfigError(f"config {where} is over {MAX_BYTES} characters: not a trainer config")
    try:
        data = json.loads(text, parse_int=_whole_number)
    except RecursionError:
        raise TrainerConfigError(f"config {where} nests deeper than {MAX_DEPTH} levels") from None
    except ValueError:
        data = _yaml(text, where)
    if not isinstance(data, dict):
        raise TrainerConfigError(f"config {where} must hold an object of fields, got {show(data)}")
    check_bounds(data, where)
    return data


def check_bounds(data: Any, where: str = "config") -> None:
    """Walk ``data`` once, iteratively: at most ``MAX_DEPTH`` deep and ``MAX_VALUES`` values
    (a cycle or an alias bomb hits the second)."""
    stack: list[tuple[Any, int, Any]] = [(data, 0, None)]
    seen = 0
    while stack:
        value, depth, field = stack.pop()
        seen += 1
        if seen > MAX_VALUES:
            raise TrainerConfigError(f"{where} holds more than {MAX_VALUES} values (an alias bomb or a cycle?)")
        if depth > MAX_DEPTH:
            raise TrainerConfigError(f"{where} nests deeper than {MAX_DEPTH} levels")
        if isinstance(value, _LongNumber):
            name = quoted(field) if field is not None else "a key"
            raise TrainerConfigError(
                f"config {where}: field {name} holds a whole number of {value.digits} digits (at most {MAX_DIGITS} read)"
            )
        if isinstance(value, Mapping):
            stack.extend((v, depth + 1, k) for k, v in _pairs(value))
            stack.extend((k, depth + 1, None) for k in _keys(value))
        elif isinstance(value, (list, tuple, set, frozenset)):
            stack.extend((v, depth + 1, field) for v in _first(value))


def _first(values: Any) -> list:
    """At most ``MAX_VALUES + 1`` members: enough to refuse, never the whole of a huge one."""
    out = []
    for v in values:
        out.append(v)
        if len(out) > MAX_VALUES:
            break
    return out


def _pairs(m: Mapping) -> list:
    return _first(m.items())


def _keys(m: Mapping) -> list:
    return _first(m.keys())


def _yaml(text: str, where: str) -> Any:
    import yaml

    class Loader(yaml.SafeLoader):
        """SafeLoader that counts depth and aliases while composing, before anything is built."""

        depth = 0
        aliases = 0

        def compose_node(self, parent, index):  # noqa: ANN001 - yaml's signature
            if self.check_event(yaml.AliasEvent):
                self.aliases += 1
                if self.aliases > MAX_ALIASES:
                    raise TrainerConfigError(f"config {where} uses more than {MAX_ALIASES} YAML aliases")
            self.depth += 1
            if self.depth > MAX_DEPTH:
                raise TrainerConfigError(f"config {where} nests deeper than {MAX_DEPTH} levels")
            try:
                return super().compose_node(parent, index)
            finally:
                self.depth -= 1

        def construct_yaml_int(self, node):  # noqa: ANN001 - yaml's signature
            digits = sum(c.isdigit() for c in str(node.value))
            return _LongNumber(digits) if digits > MAX_DIGITS else super().construct_yaml_int(node)

    Loader.add_constructor("tag:yaml.org,2002:int", Loader.construct_yaml_int)

    try:
        return yaml.load(text, Loader=Loader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise TrainerConfigError(f"config {where} is neither JSON nor YAML: {first[:100]}") from None
    except (ValueError, RecursionError, OverflowError) as exc:  # an int over Python's digit limit
        first = str(exc).splitlines()[0][:100] if str(exc) else ""
        raise TrainerConfigError(f"config {where}: {type(exc).__name__}: {first}") from None
