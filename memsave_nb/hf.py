"""What Hugging Face (and peft) models bring to a plan: tied parameters and the KV cache.

Works on any ``nn.Module``; nothing here imports ``transformers``.

**Tied parameters.** One parameter object reachable under several names (GPT-2's
``lm_head.weight`` *is* ``transformer.wte.weight``). ``named_parameters()`` lists it once, under the
first owner (its *canonical* name). memsave_nb treats it as one parameter: a plan freezes it when
``frozen`` selects any of its names and trains it when ``trainable`` selects any of its names
(``trainable`` wins, as for every parameter). Counts and name lists report it once, by its
canonical name. :func:`tied_parameters` maps canonical names to all names.

**KV cache.** Decoders return a key/value cache when ``config.use_cache`` is on (Hugging Face's
default). Checkpointed regions and the cache do not mix: SAC fails in backward
(``aten.slice.Tensor encountered during backward but not found in storage``), and Hugging Face's own
``gradient_checkpointing_enable()`` turns the cache off. A plan with regions turns it off for the
step (:func:`cache_off`) and puts every config back as it was; a batch that passes
``use_cache=True`` itself is refused (:func:`check_batch_cache`), since overriding the user's own
argument silently would measure a step their script does not run.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Mapping

from torch import nn

from memsave_nb.checkpointing import PlanError

__all__ = [
    "parameter_names",
    "tied_parameters",
    "resolve_flag",
    "tie_note",
    "cache_configs",
    "has_kv_cache",
    "check_batch_cache",
    "cache_off",
]


def parameter_names(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """Every parameter once, ``{canonical name: all its names}``, in ``named_parameters()`` order.

    The canonical name is the one ``named_parameters()`` gives (the first owner's)."""
    by_id: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(param), []).append(name)
    return {names[0]: tuple(names) for names in by_id.values()}


def tied_parameters(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """The parameters reachable under more than one name: ``{canonical name: all names}``.

    ``tied_parameters(gpt2) == {"transformer.wte.weight": ("transformer.wte.weight", "lm_head.weight")}``;
    empty for a model without ties. Any ``nn.Module``."""
    return {name: names for name, names in parameter_names(model).items() if len(names) > 1}


# -- KV cache --------------------------------------------------------------------------------------


def _configs(model: nn.Module) -> Iterator[Any]:
    seen: set[int] = set()
    for module in model.modules():
        config = module.__dict__.get("config")
        if config is None or id(config) in seen or not hasattr(config, "use_cache"):
            continue
        seen.add(id(config))
        yield config


def cache_configs(model: nn.Module) -> list[Any]:
    """The model's configs (Hugging Face ``PretrainedConfig`` objects, found on any submodule,
    each once) whose ``use_cache`` is on."""
    return [c for c in _configs(model) if getattr(c, "use_cache", False) is True]


def has_kv_cache(model: nn.Module) -> bool:
    """True when a forward of this model would build a KV cache by default (``config.use_cache``)."""
    return bool(cache_configs(model))


def check_batch_cache(batch: Any) -> None:
    """Refuse a batch that asks for the KV cache itself (``use_cache=True`` in a dict batch)."""
    if isinstance(batch, Mapping) and batch.get("use_cache") is True:
        raise PlanError(
            "the batch passes use_cache=True, and checkpointed regions cannot run with the KV cache "
            "(its views break recomputation in backward): drop use_cache from the batch or pass use_cache=False"
        )


def _refuse_cache_kwarg(module: nn.Module, args: tuple, kwargs: dict) -> None:
    check_batch_cache(kwargs)


def cache_off(model: nn.Module, batch: Any = None) -> Callable[[], None]:
    """Turn the KV cache off for a step with checkpointed regions; return the undo.

    Sets ``use_cache = False`` on each config whose cache is on and puts back exactly what was
    there (an instance attribute, or none). ``batch`` (a dict, or a factory) is checked first:
    a dict that passes ``use_cache=True`` raises :class:`PlanError` before anything changes; for a
    factory, a forward pre-hook on the root raises the same error when the model is called with it.
    """
    if not any(True for _ in _configs(model)):
        return lambda: None  # no Hugging Face config: nothing to turn off, nothing to check
    check_batch_cache(batch)
    configs = cache_configs(model)
    changed: list[tuple[Any, Any]] = []  # (config, previous instance value or _MISSING)

    def undo() -> None:
        for config, previous in reversed(changed):
            if previous is _MISSING:
                delattr(config, "use_cache")
            else:
                setattr(config, "use_cache", previous)
        changed.clear()

    try:
        for config in configs:
            attrs = getattr(config, "__dict__", None)
            previous = attrs.get("use_cache", _MISSING) if attrs is not None else config.use_cache
            try:
                config.use_cache = False
            except (AttributeError, TypeError) as exc:
                raise PlanError(
                    f"checkpointed regions need the KV cache off, but {type(config).__name__}.use_cache "
                    f"cannot be set ({exc}); build the model with use_cache=False"
                ) from None
            changed.append((config, previous))
    except BaseException:
        undo()
        raise
    if callable(batch):
        handle = model.register_forward_pre_hook(_refuse_cache_kwarg, with_kwargs=True)

        def undo_all() -> None:
            handle.remove()
            undo()

        return undo_all
    return undo


_MISSING = object()


def resolve_flag(names: tuple[str, ...], current: bool, frozen: tuple[str, ...], trainable: tuple[str, ...]) -> bool:
    """Whether a parameter known by ``names`` requires grad under a plan's ``frozen``/``trainable``
    (``current``: its flag now, kept when the plan names neither). Any name selected counts."""
    from memsave_nb.naming import selects

    if not frozen and not trainable:
        return current
    flag = current
    if any(selects(n, frozen) for n in names):
        flag = False
    if any(selects(n, trainable) for n in names):
        flag = True
    return flag


def tie_note(plan: Any, model: nn.Module) -> str:
    """What a plan trains through ties that its names do not say, as `` (note)`` or ``""``.

    GPT-2's head only: `` (lm_head.weight is tied to transformer.wte.weight, which trains too)``."""
    from memsave_nb.naming import selects

    if not plan.trainable:
        return ""
    notes = []
    for names in tied_parameters(model).values():
        chosen = [n for n in names if selects(n, plan.trainable)]
        others = [n for n in names if n not in chosen]
        if chosen and others:
            notes.append(f"{chosen[0]} is tied to {', '.join(others)}, which trains too")
    return f" ({'; '.join(notes)})" if notes else ""
