"""IPython magics: a thin parser over the public API.

``%load_ext memsave_nb`` registers:

- ``%memsave [OPTIONS] MODEL BATCH... [-- OPTIONS]`` opens the explorer
  (:func:`memsave_nb.ui.explorer.explore`) on objects of the notebook. MODEL is a name (or an
  expression without spaces); everything after it is the batch, a Python expression that may hold
  spaces: ``%memsave mlp torch.randn(4, 7)``. Options (``--loss EXPR``, ``--optimizer
  adamw|sgd|none``, ``--device cpu|cuda``, ``--fake``, ``--static``) come before MODEL or after a
  ``--``: ``%memsave --fake model (x, mask)`` or ``%memsave model (x, mask) -- --loss "F.mse_loss(out, y)"``;
- ``%%memsave [-r] [-m MODEL] [-t]`` runs the cell once as a training step under the tracker
  (:func:`memsave_nb.measure.cell.measure_callable`) and prints peak and saved activations;
  ``-r`` returns the Measurement. A failing cell gives one line (the line of the cell, the module
  running, the error); ``-t`` shows the full traceback instead;
- ``%memsave_report [FILE.html]`` writes the HTML report of the session of the explorer opened
  last (by ``%memsave`` or ``explore()``), else of the last ``%%memsave`` measurement
  (:func:`memsave_nb.report.write_report`); without a path to ``memsave_report.html`` in the
  working directory, and says where.

A ``--loss`` that uses the name ``out`` is an expression in the model's output; otherwise it must
be a function. An error raised by the loss is reported as "in the loss", not as a forward error.

Mistakes (an unknown name, a bad option, no session yet) raise ``UsageError`` with one line.
"""

from __future__ import annotations

import re
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from .errors import MemsaveError, WorkloadError, not_one_of
from .vocabulary import NO_OPTIMIZER
from .vocabulary import OPTIMIZERS as _REGISTERED_OPTIMIZERS

if TYPE_CHECKING:
    from IPython.core.interactiveshell import InteractiveShell

OPTIMIZERS = (*_REGISTERED_OPTIMIZERS, NO_OPTIMIZER)
DEFAULT_REPORT = "memsave_report.html"
CELL_FILENAME = "<%%memsave cell>"


def _token(text: str, i: int) -> tuple[str, int]:
    """The shell-like token starting at ``text[i]`` (quotes kept, as IPython's splitter does) and
    the index after it."""
    j, quote = i, None
    while j < len(text):
        c = text[j]
        if quote:
            if c == quote:
                quote = None
        elif c in "'\"":
            quote = c
        elif c.isspace():
            break
        j += 1
    return text[i:j], j


def split_memsave_line(line: str) -> tuple[str, str, str]:
    """``(options, model, batch)`` of a ``%memsave`` line: options before MODEL or after ``--``,
    MODEL the first other token, the batch everything after it (spaces allowed)."""
    text = line.strip()
    options: list[str] = []
    takes_value = ("--loss", "--optimizer", "--device")
    i = 0
    while True:
        while i < len(text) and text[i].isspace():
            i += 1
        if (
            i >= len(text)
            or not text.startswith("-", i)
            or text.startswith("--", i)
            and text[i : i + 3].strip() == "--"
        ):
            break
        tok, i = _token(text, i)
        options.append(tok)
        if tok in takes_value:
            while i < len(text) and text[i].isspace():
                i += 1
            value, i = _token(text, i)
            options.append(value)
    rest = text[i:]
    if rest.startswith("--") and rest[2:3] in ("", " "):  # "%memsave -- model batch"
        rest = rest[2:].strip()
    model, j = _token(rest, 0)
    batch = rest[j:].strip()
    for sep in (" -- ", " --\t"):
        if sep in f" {batch} " and batch:
            head, _, tail = f" {batch} ".partition(sep)
            batch, options = head.strip(), options + [tail.strip()]
            break
    if batch.endswith(" --") or batch == "--":
        batch = batch[:-2].strip()
    cut = _trailing_options_at(batch)
    if cut is not None:  # "%memsave model x --fake": options after the batch, at its top level
        batch, options = batch[:cut].strip(), options + [batch[cut:].strip()]
    return " ".join(o for o in options if o), model, batch


LONG_OPTIONS = ("--loss", "--optimizer", "--device", "--fake", "--static")


def _trailing_options_at(expr: str) -> int | None:
    """Where a known ``--option`` starts at the top level of ``expr`` (outside brackets and
    quotes, after whitespace), or None."""
    depth, quote, i = 0, None, 0
    while i < len(expr):
        c = expr[i]
        if quote:
            if c == quote:
                quote = None
        elif c in "'\"":
            quote = c
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif depth == 0 and c == "-" and i > 0 and expr[i - 1].isspace():
            word = expr[i:].split(None, 1)[0]
            if word in LONG_OPTIONS or re.fullmatch(r"--[A-Za-z][\w-]*", word):  # an unknown one: argparse says so
                return i
        i += 1
    return None


@magics_class
class MemsaveMagics(Magics):
    """The magics; the last explorer opened (``self.explorer``) is the one reports describe."""

    def __init__(self, shell: Any):
        super().__init__(shell)
        self.explorer: Any = None
        self.session: Any = None
        self.last_measurement: Any = None

    # -- helpers --------------------------------------------------------------------------------
    def _ipython(self) -> InteractiveShell:
        """The shell these magics were registered with (IPython types ``shell`` as Optional)."""
        assert self.shell is not None
        return self.shell

    def _eval(self, expr: str, what: str) -> Any:
        expr = _unquote(expr)
        try:
            return self._ipython().ev(expr)
        except NameError as exc:
            raise UsageError(f"{what} {_q(expr)}: {_first(exc)}") from None
        except SyntaxError as exc:
            raise UsageError(f"{what} {_q(expr)} is not a Python expression: {_first(exc.msg)}") from None
        except Exception as exc:  # noqa: BLE001 - the user's expression failed
            raise UsageError(f"{what} {_q(expr)} failed: {type(exc).__name__}: {_first(exc)}") from None

    def _loss(self, expr: str | None) -> Any:
        """``--loss``: a callable (``F.mse_loss``-like on the output, or a lambda), or an
        expression in ``out``, the model's output: ``--loss "F.cross_entropy(out, y)"``. An error
        it raises is reported as "in the loss" (a WorkloadError), not as a forward error."""
        if expr is None:
            return None
        expr = _unquote(expr)
        try:
            code = compile(expr, "<--loss>", "eval")
        except SyntaxError as exc:
            raise UsageError(f"--loss {_q(expr)} is not a Python expression: {_first(exc.msg)}") from None
        if "out" in code.co_names:  # an expression in the output, not a function
            namespace = self._ipython().user_ns

            def fn(out: Any) -> Any:
                return eval(code, namespace, {"out": out})  # noqa: S307 - the user's own expression

        else:
            fn = self._eval(expr, "--loss")
            if not callable(fn):
                raise UsageError(
                    f"--loss {_q(expr)} is a {type(fn).__name__}, not a function; pass a callable or an expression in 'out'"
                )

        def loss(out: Any) -> Any:
            try:
                return fn(out)
            except MemsaveError:
                raise
            except Exception as exc:  # noqa: BLE001 - said as the user's loss failing
                raise WorkloadError(f"in the loss --loss {_q(expr)}: {type(exc).__name__}: {_first(exc)}") from exc

        return loss

    # -- %memsave -------------------------------------------------------------------------------
    @magic_arguments("%memsave")
    @argument("--loss", default=None, help="a function of the output, or an expression in 'out'")
    @argument("--optimizer", default="adamw", help="adamw, adam, sgd or none")
    @argument("--device", default="cpu", help="cpu or cuda (the model must be on it)")
    @argument("--fake", action="store_true", help="measure with fake tensors (no memory, no compute)")
    @argument("--static", action="store_true", help="no live reruns: press 'run' to measure")
    @line_magic("memsave")  # type: ignore[arg-type]  # IPython types the named form's decorator as taking Never
    def memsave(self, line: str) -> Any:
        """Open the memory explorer: ``%memsave [OPTIONS] MODEL BATCH... [-- OPTIONS]``; the batch
        is everything after the model (a Python expression, spaces allowed)."""
        options, model_expr, batch_expr = split_memsave_line(line)
        args = self._parse(self.memsave, options)
        if not model_expr:
            raise UsageError("the model is required: %memsave MODEL BATCH (options before MODEL or after --)")
        if not batch_expr:
            raise UsageError(f"the batch is required after the model: %memsave {_q(model_expr)} BATCH")
        from torch import nn

        from .ui.explorer import explore

        model = self._eval(model_expr, "model")
        if not isinstance(model, nn.Module):
            raise UsageError(f"model {_q(model_expr)} is a {type(model).__name__}, not a torch.nn.Module")
        batch = self._eval(batch_expr, "batch")
        optimizer = args.optimizer.lower()
        if optimizer not in OPTIMIZERS:
            raise UsageError(not_one_of("--optimizer", args.optimizer, ", ".join(OPTIMIZERS)))
        try:
            explorer = explore(
                model,
                batch,
                loss=self._loss(args.loss),
                optimizer=None if optimizer == "none" else optimizer,
                device=args.device,
                mode="fake" if args.fake else "real",
                live=not args.static,
            )
        except MemsaveError as exc:
            raise UsageError(str(exc)) from None
        self.explorer = explorer
        self.session = explorer.session
        return explorer

    # -- %%memsave ------------------------------------------------------------------------------
    @magic_arguments("%%memsave")
    @argument("-r", "--return", dest="return_", action="store_true", help="return the Measurement")
    @argument(
        "-m", "--model", default=None, help="the model the cell trains (default: the modules found in the notebook)"
    )
    @argument("-q", "--quiet", action="store_true", help="print nothing")
    @argument("-t", "--traceback", action="store_true", help="on an error, show the full traceback (else one line)")
    @cell_magic("memsave")  # type: ignore[arg-type]  # IPython types the named form's decorator as taking Never
    def memsave_cell(self, line: str, cell: str) -> Any:
        """Measure the cell as one training step: ``%%memsave [-r]`` then code that runs
        forward, loss, backward (and maybe an optimizer step)."""
        args = self._parse(self.memsave_cell, line)
        from torch import nn

        from .measure.cell import measure_callable

        if args.model is not None:
            model = self._eval(args.model, "model")
            if not isinstance(model, nn.Module):
                raise UsageError(f"-m {_q(args.model)} is a {type(model).__name__}, not a torch.nn.Module")
            models = [model]
        else:
            models = _top_level_modules(self._ipython().user_ns)
        code = self._ipython().transform_cell(cell)
        try:
            compiled = compile(code, CELL_FILENAME, "exec")
        except SyntaxError as exc:
            raise UsageError(f"line {exc.lineno} of the cell is not valid Python: {exc.msg}") from None
        ns = self._ipython().user_ns
        try:
            measurement, _ = measure_callable(
                lambda: exec(compiled, ns),  # noqa: S102 - the user's own cell
                models,
                data=lambda: [v for k, v in ns.items() if not k.startswith("_")],
            )
        except Exception as exc:  # noqa: BLE001 - one line (or the traceback with -t)
            if args.traceback:
                raise
            raise UsageError(cell_error_line(exc, code, models)) from None
        self.last_measurement = measurement
        if not args.quiet:
            print(cell_summary(measurement))
        return measurement if args.return_ else None

    # -- %memsave_report -------------------------------------------------------------------------
    @magic_arguments("%memsave_report")
    @argument("path", nargs="?", default=None, help=f"the HTML file to write (default: {DEFAULT_REPORT})")
    @argument("--title", default="memsave_nb report")
    @line_magic("memsave_report")  # type: ignore[arg-type]  # IPython types the named form's decorator as taking Never
    def memsave_report(self, line: str) -> Any:
        """Write the HTML report of the explorer's session: ``%memsave_report report.html``."""
        args = self._parse(self.memsave_report, line)
        from .report import write_report

        target = self.session
        if target is None:
            from .ui.explorer import last_explorer

            latest = last_explorer()
            target = latest.session if latest is not None else self.last_measurement
        if target is None:
            raise UsageError("nothing to report yet: open an explorer with %memsave MODEL BATCH (or run %%memsave)")
        path = _unquote(args.path) if args.path else DEFAULT_REPORT
        if not path.lower().endswith((".html", ".htm")):
            raise UsageError(f"{_q(path)}: the report is HTML; name the file *.html")
        try:
            written = write_report(target, path, title=args.title)
        except OSError as exc:
            raise UsageError(f"cannot write {_q(path)}: {_first(exc.strerror or exc)}") from None
        print(
            f"report written to {Path(written).resolve()}"
            + ("" if args.path else " (the default; %memsave_report FILE.html names another)")
        )
        return None

    def _parse(self, fn: Any, line: str) -> Any:
        try:
            return parse_argstring(fn, line)
        except UsageError as exc:
            raise UsageError(
                _first(str(exc).strip().splitlines()[-1], 100) if str(exc).strip() else "bad arguments"
            ) from None


def cell_error_line(exc: BaseException, code: str, models: list[Any]) -> str:
    """One line for a failing ``%%memsave`` cell: which line of the cell, which module was running,
    what went wrong, and how to see the traceback."""
    from torch import nn

    names = {id(sub): name for m in models for name, sub in m.named_modules()}
    line_no, module = None, None
    for frame, lineno in traceback.walk_tb(exc.__traceback__):
        if frame.f_code.co_filename == CELL_FILENAME:
            line_no = lineno
        owner = frame.f_locals.get("self")
        if isinstance(owner, nn.Module) and id(owner) in names:
            module = (names[id(owner)], type(owner).__name__)
    lines = code.splitlines()
    where = []
    if line_no is not None and 0 < line_no <= len(lines):
        where.append(f"line {line_no} of the cell ({lines[line_no - 1].strip()[:60]})")
    if module is not None:
        where.append(f"in module {_first(module[0], 40) or '(model)'} ({_first(module[1], 30)})")
    body = _first(f"{', '.join(where) or 'the cell'}: {_first(type(exc).__name__, 40)}: {_first(exc)}", 164)
    return f"{body}  [%%memsave -t shows the traceback]"


def _q(value: Any, limit: int = 40) -> str:
    """``repr(value)`` on one line, cut to ``limit`` characters: a hostile expression is quoted in part."""
    text = " ".join(repr(value).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _first(exc: Any, limit: int = 80) -> str:
    """An exception's (or a message's) first line, cut to ``limit`` characters."""
    lines = str(exc).strip().splitlines()
    text = lines[0].strip() if lines else ""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _unquote(expr: str) -> str:
    """IPython's argument splitter keeps the quotes around an argument that has spaces."""
    expr = expr.strip()
    if len(expr) >= 2 and expr[0] == expr[-1] and expr[0] in "'\"":
        return expr[1:-1].strip()
    return expr


def _top_level_modules(namespace: dict[str, Any]) -> list[Any]:
    """The nn.Modules of the notebook that are not part of another one, largest first."""
    from torch import nn

    modules = {id(v): v for k, v in namespace.items() if isinstance(v, nn.Module) and not k.startswith("_")}
    inner = {id(sub) for m in modules.values() for sub in list(m.modules())[1:]}
    top = [m for i, m in modules.items() if i not in inner]
    return sorted(top, key=lambda m: -sum(p.numel() for p in m.parameters()))


def cell_summary(m: Any, top: int = 5) -> str:
    """The lines ``%%memsave`` prints: peak and its split, saved activations, the top layers."""
    from .ui.format import format_bytes, format_seconds

    split = ", ".join(f"{k.replace('_', ' ')} {format_bytes(v)}" for k, v in m.peak_split.as_dict().items() if v)
    lines = [
        f"peak memory: {format_bytes(m.peak_bytes)} (during {m.peak_phase or '-'}; {split})",
        f"saved activations: {format_bytes(m.saved_bytes)}",
    ]
    if m.output_bytes:  # what only the outputs keep (logits, KV cache, loss), beside saved-for-backward
        parts = ", ".join(f"{name} {format_bytes(n)}" for name, n in m.output_parts)
        lines.append(f"outputs kept to the end of forward: {format_bytes(m.output_bytes)} ({parts})")
        lines += [f"  hint: {a}" for a in m.advice]
    if m.cuda_peak_bytes is not None:
        lines.append(f"CUDA allocator peak: {format_bytes(m.cuda_peak_bytes)}")
    leaves = sorted((r for r in m.modules if r.is_leaf and r.saved_bytes), key=lambda r: -r.saved_bytes)[:top]
    if leaves:
        lines.append("largest saved activations:")
        width = max(len(r.name) for r in leaves)
        for r in leaves:
            share = r.saved_bytes / m.saved_bytes if m.saved_bytes else 0.0
            lines.append(
                f"  {r.name:<{width}}  {r.type_name:<14} {format_bytes(r.saved_bytes):>10}  {100 * share:5.1f}%"
            )
    lines.append(f"cell time under tracking: {format_seconds(m.step_seconds)}")
    return "\n".join(lines)


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext memsave_nb``."""
    ipython.register_magics(MemsaveMagics)


def unload_ipython_extension(ipython: Any) -> None:
    """``%unload_ext memsave_nb``: remove the magics again."""
    manager = ipython.magics_manager
    for kind, names in (("line", ("memsave", "memsave_report")), ("cell", ("memsave",))):
        table = manager.magics[kind]
        for name in names:
            fn = table.get(name)
            owner = getattr(fn, "__self__", None)
            if isinstance(owner, MemsaveMagics):
                del table[name]
    manager.registry.pop("MemsaveMagics", None)
