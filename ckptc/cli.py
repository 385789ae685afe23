"""The ``ckptc`` command line: plan, show, report and pareto.

    ckptc plan FILE.py:FACTORY --budget-gb 40 -o plan.json
    ckptc show plan.json
    ckptc report FILE.py:FACTORY --budget-gb 40 --plot memory.png
    ckptc pareto FILE.py:FACTORY --plot pareto.png --solvers chen_greedy hierarchical --points 6

``FILE.py:FACTORY`` names a function in the user's own Python file, called
with no arguments.  It returns ``(model, example_inputs)``,
``(model, example_inputs, example_kwargs)``, a dict, or an object (such as
``tests.zoo.ModelCase``) with ``model``, ``example_inputs`` and optionally
``example_kwargs`` and ``loss``.  Running that file is running the user's code
on purpose; plan files, by contrast, are JSON and never executed.

Every failure the user can cause (missing file, bad spec, a factory returning
the wrong thing, a corrupt plan file, a budget that is invalid or too small)
ends with a non-zero exit status and one line on stderr; ``-v`` adds the
traceback and ckptc's log messages.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import logging
import math
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn, TextIO

import torch

import ckptc
import solvers
from ckptc import report
from ckptc._torch_internals import fake_tensor_mode
from ckptc.api import example_call
from ckptc.errors import ArgumentTypeError, CkptcError
from ckptc.options import STRATEGY_NAMES, CheckpointOptions, budget_to_bytes
from solvers import format_bytes

log = logging.getLogger("ckptc.cli")

PROG = "ckptc"
EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


# --------------------------------------------------------------------------- #
# Errors                                                                       #
# --------------------------------------------------------------------------- #


class CliError(CkptcError):
    """A failure with a message meant for the user as is (no traceback)."""

    exit_code = EXIT_FAILURE


class UsageError(CliError):
    """The command line itself is wrong (argparse's complaints end up here)."""

    exit_code = EXIT_USAGE

    def __init__(self, message: str, prog: str | None = None) -> None:
        super().__init__(message)
        self.prog = prog  # the (sub)command whose arguments are wrong, for the message prefix


class _ArgumentParser(argparse.ArgumentParser):
    """argparse, but errors raise :class:`UsageError` instead of printing usage and exiting.

    ``main`` then prints one line and returns 2, which keeps ``main(argv)``
    usable in-process (tests, notebooks).  ``--help`` still exits normally.
    """

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see '{self.prog} --help')", prog=self.prog)


def one_line(text: str) -> str:
    """Collapse a (possibly multi-line) message into one line."""
    return " ".join(str(text).split())


# --------------------------------------------------------------------------- #
# Loading the user's workload: FILE.py:FACTORY                                 #
# --------------------------------------------------------------------------- #


@dataclass
class Workload:
    """A model and one step's inputs, as a factory returned them."""

    name: str
    model: torch.nn.Module
    example_inputs: tuple[Any, ...]
    example_kwargs: dict[str, Any] = field(default_factory=dict)
    loss_fn: Callable[[Any], torch.Tensor] | None = None


_EXPECTED_RESULT = (
    "expected (model, example_inputs), (model, example_inputs, example_kwargs), a dict or an object "
    "with model, example_inputs and optionally example_kwargs and loss"
)


def split_factory_spec(spec: str) -> tuple[Path, str]:
    """``"path/to/file.py:make_model"`` -> (path, "make_model"), with the reasons a spec is unusable."""
    path_text, colon, factory = spec.rpartition(":")
    if not colon or not path_text or not factory:
        raise UsageError(f"'{spec}' is not FILE.py:FACTORY (for example models.py:make_model)")
    if not all(part.isidentifier() for part in factory.split(".")):
        raise UsageError(f"'{spec}': '{factory}' is not a Python name")
    path = Path(path_text)
    if not path.exists():
        hint = " (FACTORY names a Python file, not a module: models.py:make_model)" if path.suffix != ".py" else ""
        raise CliError(f"{path}: no such file{hint}")
    if not path.is_file():
        raise CliError(f"{path}: not a file")
    return path, factory


def _project_root(path: Path) -> Path | None:
    """The nearest folder above ``path`` holding a pyproject.toml or setup.py, if any."""
    for folder in path.resolve().parents:
        if (folder / "pyproject.toml").is_file() or (folder / "setup.py").is_file():
            return folder
    return None


@contextlib.contextmanager
def _import_paths(*directories: Path | None) -> Iterator[None]:
    """Make the user's file importable as ``python FILE.py`` (its folder) and ``python -m`` (cwd) would.

    Restored afterwards so in-process callers keep their ``sys.path``.
    """
    saved = list(sys.path)
    for directory in reversed([d for d in directories if d is not None]):
        text = str(directory.resolve())
        if text not in sys.path:
            sys.path.insert(0, text)
    try:
        yield
    finally:
        sys.path[:] = saved


def load_factory_module(path: Path) -> Any:
    """Execute the user's Python file as a fresh module (it is the user's own code)."""
    name = f"_ckptc_user_{path.stem}"
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise CliError(f"{path}: cannot be loaded as a Python module (is it a .py file?)")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module  # dataclasses and pickling look the module up by name
    try:
        module_spec.loader.exec_module(module)
    except SyntaxError as error:
        sys.modules.pop(name, None)
        raise CliError(f"{path}, line {error.lineno}: syntax error: {error.msg}") from error
    except Exception as error:
        sys.modules.pop(name, None)
        raise CliError(f"{path}: failed while loading: {type(error).__name__}: {one_line(error)}") from error
    return module


def _a_type(value: Any) -> str:
    """``value``'s type name with its article, for messages ("an int", "a list")."""
    name = type(value).__name__
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def load_workload(spec: str) -> Workload:
    """Run the factory named by ``FILE.py:FACTORY`` and check what it returned."""
    path, factory_name = split_factory_spec(spec)
    # A factory under tests/ or scripts/ usually imports its project's packages
    # (tests/factories.py imports tests.zoo), so the project root joins the
    # folders `python FILE.py` and `python -m` would search.
    with _import_paths(path.parent, _project_root(path), Path.cwd()):
        module = load_factory_module(path)
        factory: Any = module
        for part in factory_name.split("."):
            if not hasattr(factory, part):
                available = sorted(
                    n
                    for n, v in vars(module).items()
                    if callable(v) and not n.startswith("_") and getattr(v, "__module__", None) == module.__name__
                )
                hint = f"; functions defined there: {', '.join(available)}" if available else ""
                raise CliError(f"{path} has no '{factory_name}'{hint}")
            factory = getattr(factory, part)
        if not callable(factory):
            raise CliError(f"{spec}: '{factory_name}' is {_a_type(factory)}, not a function")
        log.info("calling %s", spec)
        try:
            result = factory()
        except Exception as error:
            raise CliError(f"{spec}: the factory raised {type(error).__name__}: {one_line(error)}") from error
    return workload_from(result, spec)


def workload_from(result: Any, spec: str) -> Workload:
    """Normalise a factory's result (tuple, dict or ModelCase-like object) into a :class:`Workload`."""
    loss: Any = None
    if isinstance(result, (tuple, list)):
        if len(result) not in (2, 3):
            raise CliError(f"{spec} returned {_a_type(result)} of {len(result)} items; {_EXPECTED_RESULT}")
        model, inputs = result[0], result[1]
        kwargs = result[2] if len(result) == 3 else None
    elif isinstance(result, Mapping):
        missing = [key for key in ("model", "example_inputs") if key not in result]
        if missing:
            missing_keys = " and ".join(repr(k) for k in missing)
            raise CliError(f"{spec} returned a dict without {missing_keys}; {_EXPECTED_RESULT}")
        model, inputs = result["model"], result["example_inputs"]
        kwargs = result.get("example_kwargs")
        loss = result.get("loss", result.get("loss_fn"))
    elif hasattr(result, "model") and hasattr(result, "example_inputs"):
        model, inputs = result.model, result.example_inputs
        kwargs = getattr(result, "example_kwargs", None)
        loss = getattr(result, "loss", None)
    else:
        raise CliError(f"{spec} returned {_a_type(result)}; {_EXPECTED_RESULT}")

    if not isinstance(model, torch.nn.Module):
        raise CliError(f"{spec}: the model is {_a_type(model)}, not a torch.nn.Module")
    if not any(p.requires_grad for p in model.parameters()):
        raise CliError(f"{spec}: {type(model).__name__} has no trainable parameters; there is nothing to checkpoint")
    try:
        inputs, kwargs = example_call(inputs, kwargs)
    except ArgumentTypeError as error:
        raise CliError(f"{spec}: {error}") from None
    if loss is not None and not callable(loss):
        raise CliError(f"{spec}: loss is {_a_type(loss)}; expected a function of the model output")
    name = str(
        getattr(result, "name", "")
        or (result.get("name", "") if isinstance(result, Mapping) else "")
        or type(model).__name__
    )
    return Workload(name, model, inputs, kwargs, loss)


# --------------------------------------------------------------------------- #
# Arguments                                                                    #
# --------------------------------------------------------------------------- #


def _positive_finite(text: str, unit: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a number of {unit}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive finite number of {unit}, got '{text}'")
    return value


def budget_gb_type(text: str) -> float:
    """argparse type of ``--budget-gb``: a positive finite number of GiB, at least one byte
    and at most 2**63 bytes."""
    value = _positive_finite(text, "GiB")
    try:
        budget_to_bytes(value, None)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"got '{text}': {error}") from None
    return value


def budget_bytes_type(text: str) -> int:
    """argparse type of ``--budget-bytes``: a positive whole number of bytes (``1e9`` is accepted)."""
    try:
        whole = int(text.strip().replace("_", ""))  # exact: a float would round 2**63 - 1 up to 2**63
    except ValueError:
        value = _positive_finite(text, "bytes")
        if not value.is_integer():
            raise argparse.ArgumentTypeError(f"must be a whole number of bytes, got '{text}'") from None
        whole = int(value)
    if whole < 1:
        raise argparse.ArgumentTypeError(f"must be a positive finite number of bytes, got '{text}'")
    try:
        return budget_to_bytes(None, whole)  # type: ignore[return-value]
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"got '{text}': {error}") from None


def positive_int_type(text: str) -> int:
    """argparse type of counts such as ``--points``."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def budget_from(args: argparse.Namespace) -> int | None:
    """The budget in bytes from ``--budget-gb`` / ``--budget-bytes`` (None if neither was given)."""
    return budget_to_bytes(args.budget_gb, args.budget_bytes)


def _add_common(parser: argparse.ArgumentParser, *, top_level: bool = False) -> None:
    # Subcommands must not reset a top-level "-v" to False (argparse copies
    # subparser defaults over the namespace), hence SUPPRESS below the top.
    parser.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        default=False if top_level else argparse.SUPPRESS,
        help="log what ckptc does and show tracebacks of errors",
    )


def _add_budget(parser: argparse.ArgumentParser) -> None:
    group = parser.add_mutually_exclusive_group()
    group.add_argument(
        "--budget-gb",
        type=budget_gb_type,
        metavar="GIB",
        help="peak memory of one training step in GiB (parameters, gradients, activations)",
    )
    group.add_argument("--budget-bytes", type=budget_bytes_type, metavar="N", help="the same budget in bytes")


def _add_planning(parser: argparse.ArgumentParser, *, solver: bool = True) -> None:
    if solver:
        parser.add_argument(
            "--solver", default="auto", choices=list(solvers.METHODS), help="solver for --strategy auto (default: auto)"
        )
        parser.add_argument(
            "--strategy",
            default="auto",
            choices=sorted(STRATEGY_NAMES),
            help="auto: a solver under the budget; none: keep everything; layer: per-block; "
            "segment: Chen's sqrt(n); selective: Megatron-style (default: auto)",
        )
    parser.add_argument(
        "--must-save",
        nargs="+",
        action="extend",
        default=[],
        metavar="PAT",
        help="stable-name patterns to always keep, e.g. 'transformer.h.*.attn.*' "
        "(give FILE.py:FACTORY before the patterns)",
    )
    parser.add_argument(
        "--must-recompute",
        nargs="+",
        action="extend",
        default=[],
        metavar="PAT",
        help="stable-name patterns to always recompute, e.g. '*.softmax*'",
    )
    parser.add_argument(
        "--hold-outputs",
        action="store_true",
        help="plan for a loop that keeps the forward's results (logits) until backward ends, as "
        "out = model(...); out.loss.backward() does (default: a loop that drops them once its loss is computed)",
    )


FACTORY_HELP = "a function in FILE.py returning the model and example inputs, e.g. models.py:make_model"


def build_parser() -> argparse.ArgumentParser:
    """The ``ckptc`` argument parser with its four subcommands."""
    parser = _ArgumentParser(
        prog=PROG,
        description="Plan and inspect activation checkpointing for a PyTorch training step.",
        epilog="FILE.py:FACTORY names a function returning (model, example_inputs[, example_kwargs]), "
        "a dict or an object with model/example_inputs/example_kwargs/loss.",
    )
    _add_common(parser, top_level=True)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_ArgumentParser)

    plan = commands.add_parser(
        "plan",
        help="plan a model under a budget and save the plan as JSON",
        description="Plan one training step of FACTORY's model under the budget and "
        "write the plan file; prints a one-line summary.",
    )
    plan.add_argument("factory", metavar="FILE.py:FACTORY", help=FACTORY_HELP)
    _add_budget(plan)
    _add_planning(plan)
    plan.add_argument(
        "-o", "--output", default="plan.json", metavar="PLAN.json", help="where to write the plan (default: plan.json)"
    )
    plan.add_argument(
        "--fake",
        action="store_true",
        help="run the factory under fake tensors and plan offline: no weight or activation is allocated, so a "
        "model that does not fit this machine can be planned (also for a factory that builds on the meta device)",
    )
    plan.add_argument(
        "--device",
        metavar="DEVICE",
        help="plan offline for this device (cpu, cuda): the step is captured under fake tensors there "
        "(default: the model's device; cpu for a model on meta)",
    )
    _add_common(plan)

    show = commands.add_parser(
        "show",
        help="print a plan file as a table per module",
        description="Print what a plan keeps and recomputes, per module, and a summary.",
    )
    show.add_argument("plan_file", metavar="PLAN.json")
    _add_common(show)

    report_ = commands.add_parser(
        "report",
        help="plot predicted and measured memory over one step",
        description="Plan under the budget, run one step with and without the plan, "
        "plot memory over the step (predicted and measured, with the "
        "budget) and print predicted against measured peak.",
    )
    report_.add_argument("factory", metavar="FILE.py:FACTORY", help=FACTORY_HELP)
    _add_budget(report_)
    _add_planning(report_)
    report_.add_argument("--plot", default="memory.png", metavar="PNG", help="image to write (default: memory.png)")
    _add_common(report_)

    pareto = commands.add_parser(
        "pareto",
        help="plot recompute overhead against peak memory per solver",
        description="Plan under budgets from the smallest feasible to the unoptimized "
        "peak with each solver; print the points and plot recompute "
        "(% of step FLOPs) against predicted peak.",
    )
    pareto.add_argument("factory", metavar="FILE.py:FACTORY", help=FACTORY_HELP)
    pareto.add_argument(
        "--solvers",
        nargs="+",
        default=list(report.DEFAULT_PARETO_SOLVERS),
        choices=list(solvers.METHODS),
        metavar="SOLVER",
        help=f"solvers to compare, from {', '.join(solvers.METHODS)} "
        f"(default: {' '.join(report.DEFAULT_PARETO_SOLVERS)})",
    )
    pareto.add_argument("--points", type=positive_int_type, default=6, help="budgets per solver (default: 6)")
    _add_planning(pareto, solver=False)
    pareto.add_argument("--plot", default="pareto.png", metavar="PNG", help="image to write (default: pareto.png)")
    _add_common(pareto)
    return parser


# --------------------------------------------------------------------------- #
# Progress                                                                     #
# --------------------------------------------------------------------------- #


class ProgressLine:
    """A ``progress(fraction, message)`` callback drawing one stderr line, for long solves only.

    Nothing is shown until ``delay`` seconds after the first report, so quick
    solves stay silent.  On a terminal the line is rewritten in place; when
    stderr is a file or pipe a new line is written every 10 %, so logs stay
    short.
    """

    def __init__(
        self, stream: TextIO | None = None, *, delay: float = 2.0, label: str = PROG, min_interval: float = 0.1
    ) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.delay = delay
        self.min_interval = min_interval
        self._last_write = -math.inf
        self.label = label
        self._started: float | None = None
        self._shown = False
        self._last_tenth = -1
        self._width = 0
        self._interactive = bool(getattr(self.stream, "isatty", lambda: False)())

    def __call__(self, fraction: float, message: str) -> None:
        now = time.monotonic()
        if self._started is None:
            self._started = now
        if now - self._started < self.delay:
            return
        percent = int(100 * min(1.0, max(0.0, fraction)))
        text = f"{self.label}: {percent:3d}% {message}"
        if self._interactive:
            if now - self._last_write < self.min_interval and percent < 100:
                return  # solvers report often; redrawing faster than the eye reads only costs time
            self._last_write = now
            self.stream.write("\r" + text.ljust(self._width))
            self._width = max(self._width, len(text))
        elif percent // 10 > self._last_tenth:
            self._last_tenth = percent // 10
            self.stream.write(text + "\n")
        else:
            return
        self.stream.flush()
        self._shown = True

    def finish(self) -> None:
        """End the progress line (if one was drawn) so later output starts on a fresh line."""
        if self._shown and self._interactive:
            self.stream.write("\n")
            self.stream.flush()
        self._started, self._shown, self._last_tenth, self._width = None, False, -1, 0
        self._last_write = -math.inf


# --------------------------------------------------------------------------- #
# Commands                                                                     #
# --------------------------------------------------------------------------- #


def _planning_options(args: argparse.Namespace) -> dict[str, Any]:
    """The command's planning options, checked (:class:`~ckptc.options.CheckpointOptions`) before the
    slow loading and capture; a bad value ends the command with its ``ValueError``."""
    options: dict[str, Any] = {"must_save": tuple(args.must_save), "must_recompute": tuple(args.must_recompute)}
    if args.hold_outputs:
        options["hold_outputs"] = True
    if hasattr(args, "solver"):
        options.update(solver=args.solver, strategy=args.strategy)
    try:
        CheckpointOptions.from_user(options)
    except ValueError as error:
        raise UsageError(str(error)) from None
    return options


def _ensure_writable(path: str) -> Path:
    """Fail before the (slow) planning if the output's folder does not exist."""
    target = Path(path)
    if not target.parent.exists():
        raise CliError(f"{target}: folder {target.parent} does not exist")
    if not target.parent.is_dir():
        raise CliError(f"{target}: {target.parent} is a file, not a folder")
    if target.is_dir():
        raise CliError(f"{target}: is a folder; give a file name")
    return target


def command_plan(args: argparse.Namespace, out: TextIO) -> int:
    """``ckptc plan``: plan, save, print a one-line summary."""
    output = _ensure_writable(args.output)
    options = _planning_options(args)
    progress = ProgressLine()
    with contextlib.ExitStack() as stack:
        if args.fake:
            mode, _ = fake_tensor_mode()
            stack.enter_context(mode)  # the factory's tensors are fake: nothing it builds is allocated
        workload = load_workload(args.factory)
        try:
            model_plan = ckptc.plan(
                workload.model,
                workload.example_inputs,
                workload.example_kwargs,
                budget_bytes=budget_from(args),
                loss_fn=workload.loss_fn,
                progress=progress,
                device=args.device,
                **options,
            )
        finally:
            progress.finish()
    try:
        model_plan.save(output)
    except OSError as error:
        reason = error.strerror or error
        raise CliError(f"{output}: cannot write the plan ({reason}); give another path with -o") from None
    print(f"{output}: {report.summary_line(model_plan)}", file=out)
    if model_plan.coverage is not None and model_plan.coverage.breaks:  # the step is split: say where and why
        print(model_plan.coverage, file=out)
    return EXIT_OK


def command_show(args: argparse.Namespace, out: TextIO) -> int:
    """``ckptc show``: the module table and the summary line of a plan file."""
    path = Path(args.plan_file)
    if not path.exists():
        raise CliError(f"{path}: no such file")
    if path.is_dir():
        raise CliError(f"{path}: is a folder, not a plan file")
    model_plan = ckptc.load_plan(path)
    print(report.plan_table(model_plan), file=out)
    print(file=out)
    print(report.summary_line(model_plan), file=out)
    return EXIT_OK


def command_report(args: argparse.Namespace, out: TextIO) -> int:
    """``ckptc report``: timelines, plot, predicted against measured peak."""
    output = _ensure_writable(args.plot)
    options = _planning_options(args)
    workload = load_workload(args.factory)
    budget = budget_from(args)
    progress = ProgressLine()
    try:
        timelines = report.memory_timelines(
            workload.model,
            workload.example_inputs,
            workload.example_kwargs,
            budget_bytes=budget,
            loss_fn=workload.loss_fn,
            progress=progress,
            **options,
        )
    finally:
        progress.finish()
    report.memory_timeline_plot(timelines, output, title=f"{workload.name}: memory over one training step")
    for optimized, label in ((True, "plan"), (False, "unoptimized")):
        predicted = timelines.get(optimized=optimized, measured=False)
        measured = timelines.get(optimized=optimized, measured=True)
        line = f"{label:<12} predicted peak {format_bytes(predicted.peak_bytes) if predicted else '?'}"
        if predicted and measured:
            line += (
                f", measured peak {format_bytes(measured.peak_bytes)} "
                f"({report.relative_difference(measured.peak_bytes, predicted.peak_bytes)})"
            )
        print(line, file=out)
    budget_text = "none" if budget is None else format_bytes(budget)
    plan_measured = timelines.get(optimized=True, measured=True)
    verdict = ""
    if budget is not None and plan_measured is not None:
        verdict = (
            "; measured peak is within the budget"
            if plan_measured.peak_bytes <= budget
            else "; measured peak EXCEEDS the budget"
        )
    print(
        f"budget {budget_text}, recompute {timelines.model_plan.recompute_percent:.1f}% of step FLOPs{verdict}",
        file=out,
    )
    print(f"wrote {output}", file=out)
    return EXIT_OK


def command_pareto(args: argparse.Namespace, out: TextIO) -> int:
    """``ckptc pareto``: plan across budgets per solver, print the table, plot the curves."""
    output = _ensure_writable(args.plot)
    options = _planning_options(args)
    workload = load_workload(args.factory)
    # The sweep as a whole is the long operation worth a progress line.
    progress = ProgressLine(label=f"{PROG} pareto")
    try:
        result = report.pareto_points(
            workload.model,
            workload.example_inputs,
            workload.example_kwargs,
            loss_fn=workload.loss_fn,
            solver_names=args.solvers,
            points=args.points,
            progress=progress,
            **options,
        )
    finally:
        progress.finish()
    print(report.pareto_table(result), file=out)
    print(
        f"smallest feasible {format_bytes(result.min_feasible_bytes)}, "
        f"unoptimized peak {format_bytes(result.unoptimized_peak_bytes)}",
        file=out,
    )
    report.pareto_plot(result, output, title=f"{workload.name}: recompute against peak memory")
    print(f"wrote {output}", file=out)
    return EXIT_OK


COMMANDS: dict[str, Callable[[argparse.Namespace, TextIO], int]] = {
    "plan": command_plan,
    "show": command_show,
    "report": command_report,
    "pareto": command_pareto,
}


# --------------------------------------------------------------------------- #
# Entry point                                                                  #
# --------------------------------------------------------------------------- #


@contextlib.contextmanager
def _logging_to_stderr(verbose: bool) -> Iterator[None]:
    """With ``-v``, show ckptc's INFO messages on stderr for the duration of the command.  Without it,
    torch's own log records (a failed op's traceback logged by fake tensors before the error reaches
    ckptc, which prints it as one line) stay off stderr."""
    if not verbose:
        torch_logger = logging.getLogger("torch")
        previous = torch_logger.level
        torch_logger.setLevel(logging.CRITICAL)
        try:
            yield
        finally:
            torch_logger.setLevel(previous)
        return
    logger = logging.getLogger("ckptc")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
    previous = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(previous)


def error_message(error: BaseException) -> str:
    """The one line printed for ``error``: the message of errors meant for users, the type for others."""
    if isinstance(error, solvers.InfeasibleBudgetError):
        message = error.message.removesuffix(" for this graph")
        if error.min_feasible_bytes is not None:
            message += f"; use --budget-bytes {error.min_feasible_bytes} or more"
        return one_line(message)
    if isinstance(error, (CliError, CkptcError)):
        return one_line(error)
    if isinstance(error, OSError) and error.filename is not None:
        return one_line(f"{error.filename}: {error.strerror or error}")
    if isinstance(error, (ValueError, TypeError)):
        return one_line(error)  # ckptc's own argument checks (budget, patterns) say what is wrong
    return one_line(f"{type(error).__name__}: {error} (run with -v for the traceback)")


def _silence_stdout() -> None:
    """Point stdout at /dev/null so Python's exit-time flush does not fail on a closed pipe again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass  # stdout is not a real file (captured in-process): nothing to flush


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``ckptc`` command line; returns the exit status (``--help`` raises ``SystemExit(0)``)."""
    parser = build_parser()
    command = "ckptc"
    verbose = False
    try:
        args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
        command = f"{PROG} {args.command}" if args.command else PROG
        verbose = args.verbose
        if args.command is None:
            raise UsageError(f"choose a command: {', '.join(COMMANDS)} (see '{PROG} --help')")
        with _logging_to_stderr(verbose):
            return COMMANDS[args.command](args, sys.stdout)
    except BrokenPipeError:
        # The reader went away (`ckptc show plan.json | head`): not an error worth a message.
        _silence_stdout()
        return EXIT_FAILURE
    except KeyboardInterrupt:
        print(f"{command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as error:  # every failure becomes one line; -v shows where it came from
        if verbose:
            traceback.print_exc(file=sys.stderr)
        if isinstance(error, UsageError) and error.prog:
            command = error.prog
        print(f"{command}: error: {error_message(error)}", file=sys.stderr)
        return error.exit_code if isinstance(error, CliError) else EXIT_FAILURE


if __name__ == "__main__":
    raise SystemExit(main())
