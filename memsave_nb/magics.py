"""IPython magics: a thin parser over the public API.

``%load_ext memsave_nb`` registers:

- ``%memsave MODEL BATCH [--loss EXPR] [--optimizer adamw|sgd|none] [--device cpu|cuda] [--fake]``
  opens the explorer (:func:`memsave_nb.ui.explorer.explore`) on objects of the notebook;
- ``%%memsave [-r] [-m MODEL]`` runs the cell once as a training step under the tracker
  (:func:`memsave_nb.measure.cell.measure_callable`) and prints peak and saved activations;
  ``-r`` returns the Measurement;
- ``%memsave_report FILE.html`` writes the HTML report of the session of the explorer opened
  last (by ``%memsave`` or ``explore()``), else of the last ``%%memsave`` measurement
  (:func:`memsave_nb.report.write_report`).

MODEL, BATCH and ``--loss`` are Python expressions in the notebook's namespace; quote one that
holds spaces: ``%memsave model "(x, mask)" --loss "F.cross_entropy(out, y)"``. A ``--loss`` that
uses the name ``out`` is an expression in the model's output; otherwise it must be a function.

Mistakes (an unknown name, a bad option, no session yet) raise ``UsageError`` with one line.
"""

from __future__ import annotations

from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from .errors import MemsaveError

OPTIMIZERS = ("adamw", "adam", "sgd", "none")


@magics_class
class MemsaveMagics(Magics):
    """The magics; the last explorer opened (``self.explorer``) is the one reports describe."""

    def __init__(self, shell: Any):
        super().__init__(shell)
        self.explorer: Any = None
        self.session: Any = None
        self.last_measurement: Any = None

    # -- helpers --------------------------------------------------------------------------------
    def _eval(self, expr: str, what: str) -> Any:
        expr = _unquote(expr)
        try:
            return self.shell.ev(expr)
        except NameError as exc:
            raise UsageError(f"{what} {expr!r}: {exc}") from None
        except SyntaxError as exc:
            raise UsageError(f"{what} {expr!r} is not a Python expression: {exc.msg}") from None
        except Exception as exc:  # noqa: BLE001 - the user's expression failed
            raise UsageError(f"{what} {expr!r} failed: {type(exc).__name__}: {exc}") from None

    def _loss(self, expr: str | None) -> Any:
        """``--loss``: a callable (``F.mse_loss``-like on the output, or a lambda), or an
        expression in ``out``, the model's output: ``--loss "F.cross_entropy(out, y)"``."""
        if expr is None:
            return None
        expr = _unquote(expr)
        try:
            code = compile(expr, "<--loss>", "eval")
        except SyntaxError as exc:
            raise UsageError(f"--loss {expr!r} is not a Python expression: {exc.msg}") from None
        if "out" in code.co_names:  # an expression in the output, not a function
            namespace = self.shell.user_ns

            def loss(out: Any) -> Any:
                return eval(code, namespace, {"out": out})  # noqa: S307 - the user's own expression

            return loss
        value = self._eval(expr, "--loss")
        if not callable(value):
            raise UsageError(
                f"--loss {expr!r} is a {type(value).__name__}, not a function; pass a callable or an expression in 'out'"
            )
        return value

    # -- %memsave -------------------------------------------------------------------------------
    @magic_arguments("%memsave")
    @argument("model", help="the model: a torch.nn.Module in the notebook")
    @argument("batch", help="the batch: a tensor, tuple, dict or a function returning one")
    @argument("--loss", default=None, help="a function of the output, or an expression in 'out'")
    @argument("--optimizer", default="adamw", help="adamw, adam, sgd or none")
    @argument("--device", default="cpu", help="cpu or cuda (the model must be on it)")
    @argument("--fake", action="store_true", help="measure with fake tensors (no memory, no compute)")
    @argument("--static", action="store_true", help="no live reruns: press 'run' to measure")
    @line_magic("memsave")
    def memsave(self, line: str) -> Any:
        """Open the memory explorer: ``%memsave model batch [--loss EXPR] [--fake]``."""
        args = self._parse(self.memsave, line)
        from torch import nn

        from .ui.explorer import explore

        model = self._eval(args.model, "model")
        if not isinstance(model, nn.Module):
            raise UsageError(f"model {args.model!r} is a {type(model).__name__}, not a torch.nn.Module")
        batch = self._eval(args.batch, "batch")
        optimizer = args.optimizer.lower()
        if optimizer not in OPTIMIZERS:
            raise UsageError(f"--optimizer {args.optimizer!r}: choose one of {', '.join(OPTIMIZERS)}")
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
    @argument("-m", "--model", default=None, help="the model the cell trains (default: the modules found in the notebook)")
    @argument("-q", "--quiet", action="store_true", help="print nothing")
    @cell_magic("memsave")
    def memsave_cell(self, line: str, cell: str) -> Any:
        """Measure the cell as one training step: ``%%memsave [-r]`` then code that runs
        forward, loss, backward (and maybe an optimizer step)."""
        args = self._parse(self.memsave_cell, line)
        from torch import nn

        from .measure.cell import measure_callable

        if args.model is not None:
            model = self._eval(args.model, "model")
            if not isinstance(model, nn.Module):
                raise UsageError(f"-m {args.model!r} is a {type(model).__name__}, not a torch.nn.Module")
            models = [model]
        else:
            models = _top_level_modules(self.shell.user_ns)
        code = self.shell.transform_cell(cell)
        compiled = compile(code, "<%%memsave cell>", "exec")
        ns = self.shell.user_ns
        measurement, _ = measure_callable(
            lambda: exec(compiled, ns),  # noqa: S102 - the user's own cell
            models,
            data=lambda: [v for k, v in ns.items() if not k.startswith("_")],
        )
        self.last_measurement = measurement
        if not args.quiet:
            print(cell_summary(measurement))
        return measurement if args.return_ else None

    # -- %memsave_report -------------------------------------------------------------------------
    @magic_arguments("%memsave_report")
    @argument("path", help="the HTML file to write")
    @argument("--title", default="memsave_nb report")
    @line_magic("memsave_report")
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
        path = _unquote(args.path)
        if not path.lower().endswith((".html", ".htm")):
            raise UsageError(f"{path!r}: the report is HTML; name the file *.html")
        try:
            written = write_report(target, path, title=args.title)
        except OSError as exc:
            raise UsageError(f"cannot write {path!r}: {exc.strerror or exc}") from None
        print(f"report written to {written}")
        return None

    def _parse(self, fn: Any, line: str) -> Any:
        try:
            return parse_argstring(fn, line)
        except UsageError as exc:
            raise UsageError(str(exc).splitlines()[-1] if str(exc) else "bad arguments") from None


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
    if m.cuda_peak_bytes is not None:
        lines.append(f"CUDA allocator peak: {format_bytes(m.cuda_peak_bytes)}")
    leaves = sorted((r for r in m.modules if r.is_leaf and r.saved_bytes), key=lambda r: -r.saved_bytes)[:top]
    if leaves:
        lines.append("largest saved activations:")
        width = max(len(r.name) for r in leaves)
        for r in leaves:
            share = r.saved_bytes / m.saved_bytes if m.saved_bytes else 0.0
            lines.append(f"  {r.name:<{width}}  {r.type_name:<14} {format_bytes(r.saved_bytes):>10}  {100 * share:5.1f}%")
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
