"""The module tree behind the layer table, and how its checkboxes map to Plan fields and back.

Plain data, no widgets. The table keeps one boolean per module for "freeze" and one for
"memory-saving layers". Each box stands for a set of *units* below the module: its parameters
(freeze) or its swappable layers (memory-saving). A box is checked when all its units are on;
ticking it turns all of them on. The functions here turn unit states into the shortest list of
names a :class:`~memsave_nb.plan.Plan` understands, and a Plan back into unit states.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

from torch import nn

ROOT = ""


def slug(name: str) -> str:
    """A CSS-class-safe spelling of a module name: ``layers.0.conv1`` -> ``layers-0-conv1``;
    the root is ``root``."""
    if name == ROOT:
        return "root"
    return "".join(c if c.isalnum() or c in "-_" else "-" for c in name)


def parent_of(name: str) -> str | None:
    if name == ROOT:
        return None
    return name.rpartition(".")[0]


def _under(unit: str, module: str) -> bool:
    return module == ROOT or unit == module or unit.startswith(module + ".")


@dataclass
class ModuleTree:
    """Module names in ``named_modules()`` order, parent/children links, and the units below each.

    ``params[m]``: parameter names below module ``m`` (its own and its children's);
    ``swappable[m]``: names of modules below ``m`` (``m`` included) the memory-saving registry swaps.
    """

    names: list[str]
    children: dict[str, list[str]]
    type_names: dict[str, str]
    own_params: dict[str, int]
    params: dict[str, list[str]]
    swappable: dict[str, list[str]]
    initial_frozen: dict[str, bool]  # parameter name -> requires_grad False when the tree was built

    @classmethod
    def from_model(cls, model: nn.Module, swappable_types: tuple[type, ...] = ()) -> "ModuleTree":
        names: list[str] = []
        children: dict[str, list[str]] = {}
        type_names: dict[str, str] = {}
        own: dict[str, int] = {}
        swap_names = []
        for name, module in model.named_modules():
            names.append(name)
            children[name] = []
            type_names[name] = type(module).__name__
            own[name] = sum(p.numel() for p in module._parameters.values() if p is not None)
            if type(module) in swappable_types:
                swap_names.append(name)
        for name in names:
            parent = parent_of(name)
            if parent is not None and parent in children:
                children[parent].append(name)
        named_params = list(model.named_parameters())
        params = {m: [p for p, _ in named_params if _under(p, m)] for m in names}
        swappable = {m: [s for s in swap_names if _under(s, m)] for m in names}
        initial = {p: not t.requires_grad for p, t in named_params}
        return cls(names, children, type_names, own, params, swappable, initial)

    @property
    def all_params(self) -> list[str]:
        return self.params.get(ROOT, [])

    @property
    def all_swappable(self) -> list[str]:
        return self.swappable.get(ROOT, [])

    def descendants(self, name: str) -> list[str]:
        out, stack = [], list(reversed(self.children.get(name, [])))
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(reversed(self.children.get(n, [])))
        return out

    def depth(self, name: str) -> int:
        return 0 if name == ROOT else name.count(".") + 1

    # -- boxes from units ---------------------------------------------------------------------
    def boxes(self, units: dict[str, list[str]], on: set[str]) -> dict[str, bool]:
        """Module -> checked: every unit below it is on (and there is at least one)."""
        return {m: bool(units[m]) and all(u in on for u in units[m]) for m in self.names}

    # -- freezing -----------------------------------------------------------------------------
    def frozen_from_plan(self, frozen: tuple[str, ...] | list[str], trainable: tuple[str, ...] | list[str]) -> set[str]:
        """Parameter names frozen under a plan's ``frozen``/``trainable`` (same rules as Plan)."""
        from memsave_nb.plan import selects

        out = set()
        for p in self.all_params:
            state = self.initial_frozen.get(p, False)
            if frozen or trainable:
                if selects(p, list(frozen)):
                    state = True
                if selects(p, list(trainable)):
                    state = False
            if state:
                out.add(p)
        return out

    def freeze_fields(self, frozen_params: set[str]) -> tuple[list[str], list[str]]:
        """``(frozen, trainable)`` names for a Plan that freeze exactly ``frozen_params``.

        A Plan changes only the parameters it names; the rest keep the model's own flags. So
        top-down: a subtree where nothing differs from the model's flags is skipped; a subtree
        that ends up all frozen (or all trainable) is listed by its module name; a mixed one
        lists its own differing parameters by name and recurses into its children.
        """
        frozen: list[str] = []
        trainable: list[str] = []
        self._cover(ROOT, frozen_params, frozen, trainable)
        changes = (compress_to_patterns(frozen, self.all_params), compress_to_patterns(trainable, self.all_params))
        if not frozen_params or not (frozen or trainable):
            return changes
        # or: freeze everything, then name what trains ("*" then "*.bias" for BitFit); the shorter wins
        trains = [p for p in self.all_params if p not in frozen_params]
        t_fields: list[str] = []
        self._cover_trainable(ROOT, set(trains), t_fields)
        whole = (["*"], compress_to_patterns(t_fields, self.all_params))
        return whole if len(whole[0]) + len(whole[1]) < len(changes[0]) + len(changes[1]) else changes

    def _cover_trainable(self, module: str, on: set[str], out: list[str]) -> None:
        """The shortest module/parameter names that select exactly the parameters ``on``."""
        units = self.params[module]
        if not any(u in on for u in units):
            return
        if all(u in on for u in units):
            out.append(module if module != ROOT else "*")
            return
        for p in units:
            if p.rpartition(".")[0] == module and p in on:
                out.append(p)
        for child in self.children[module]:
            self._cover_trainable(child, on, out)

    def _cover(self, module: str, on: set[str], frozen: list[str], trainable: list[str]) -> None:
        units = self.params[module]
        if not any((u in on) != self.initial_frozen.get(u, False) for u in units):
            return  # as the model has it
        states = {u in on for u in units}
        if len(states) == 1:
            (frozen if states.pop() else trainable).append(module)
            return
        for p in units:  # mixed: own parameters by name, children recursively
            if p.rpartition(".")[0] == module and (p in on) != self.initial_frozen.get(p, False):
                (frozen if p in on else trainable).append(p)
        for child in self.children[module]:
            self._cover(child, on, frozen, trainable)

    # -- memory-saving layers -----------------------------------------------------------------
    def swapped_from_plan(self, memsave: tuple[str, ...] | list[str]) -> set[str]:
        """Swappable layer names a plan's ``memsave`` selects (``convert``'s name/pattern rules)."""
        pats = list(memsave)
        if "*" in pats or ROOT in pats:
            return set(self.all_swappable)
        return {s for s in self.all_swappable if any(s == p or fnmatch.fnmatchcase(s, p) for p in pats)}

    def memsave_fields(self, on: set[str]) -> list[str]:
        """``Plan.memsave``: ``["*"]`` when every swappable layer is on; otherwise the top-most
        fully-on modules, a leaf by its name and a subtree as ``"name.*"``."""
        if not on:
            return []
        if set(self.all_swappable) <= on:
            return ["*"]
        out: list[str] = []

        def visit(module: str) -> None:
            units = self.swappable[module]
            if not units:
                return
            if all(u in on for u in units):
                if module in units and len(units) == 1:
                    out.append(module)
                else:
                    out.append(f"{module}.*")
                    if module in units:
                        out.append(module)
                return
            if module in units and module in on:
                out.append(module)
            for child in self.children[module]:
                visit(child)

        visit(ROOT)
        return out


def compress_to_patterns(names: list[str], all_params: list[str], min_group: int = 3) -> list[str]:
    """Replace parameter names that share a last part by one pattern when the pattern selects
    exactly them: 57 ``"<layer>.bias"`` names of a BitFit plan become ``"*.bias"``. Names that are
    not parameters (module names) and groups a pattern would over-select stay as they are."""
    from memsave_nb.plan import selects

    params = set(all_params)
    groups: dict[str, list[str]] = {}
    for n in names:
        if n in params and "." in n:
            groups.setdefault(n.rpartition(".")[2], []).append(n)
    replaced: dict[str, str] = {}
    for attr, members in groups.items():
        if len(members) < min_group:
            continue
        pattern = f"*.{attr}"
        if {p for p in all_params if selects(p, [pattern])} == set(members):
            for n in members:
                replaced[n] = pattern
    out: list[str] = []
    for n in names:
        item = replaced.get(n, n)
        if item not in out:
            out.append(item)
    return out
