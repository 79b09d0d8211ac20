"""`tpweave.compile` and `tpweave.report`."""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.distributed as dist

from tpweave.compiler.compiled import CompiledTP, default_num_tokens
from tpweave.compiler.options import CompileOptions, CompilePlan, plan
from tpweave.compiler.report import CompileReport
from tpweave.compiler.tp_group import TPGroup
from tpweave.compiler.tp_pass import TPBackend
from tpweave.log import configure_from_env
from tpweave.runtime.agreement import check_ranks_agree


def compile(
    module: torch.nn.Module,
    *,
    group: dist.ProcessGroup | str | None = None,
    options: CompileOptions | None = None,
    **overrides: Any,
) -> CompiledTP:
    """Compile a TP module (or its bound forward: `model.forward = tpweave.compile(model.forward)` keeps
    HF's `model.generate` working) with sequence parallelism and async TP: one graph per variant serves
    every M >= 2. `options` (default CompileOptions()) with `overrides` (option name -> value) applied;
    `group`: the TP process group (default: the world). See docs/user_guide.md."""
    configure_from_env()
    options = (options or CompileOptions()).replace(overrides)
    owner = _owner(module)
    tp = TPGroup.of(group)
    the_plan = plan(options, tp, owner)
    _check_ranks_agree(the_plan, tp)
    report = the_plan.new_report()
    backends = {name: TPBackend(variant=name, tp=tp, plan=the_plan, report=report) for name in the_plan.variants}
    variants = {name: torch.compile(module, backend=backend, dynamic=None) for name, backend in backends.items()}
    return CompiledTP(owner, variants, the_plan, report, options.num_tokens_fn or default_num_tokens, eager=module)


def _owner(module: Any) -> torch.nn.Module:
    """The nn.Module being compiled: `module` itself, or the module of a bound method (model.forward)."""
    if isinstance(module, torch.nn.Module):
        return module
    if inspect.ismethod(module) and isinstance(module.__self__, torch.nn.Module):
        return module.__self__
    raise TypeError(f"tpweave.compile takes an nn.Module or a bound method of one (model.forward), got {module!r}")


def _check_ranks_agree(the_plan: CompilePlan, tp: TPGroup) -> None:
    """Ranks that compiled different graphs or strategies would wait on each other's collectives forever
    (e.g. a calibration table found, or found corrupt, on some ranks only): refuse up front."""
    if tp.world_size == 1:
        return
    what = "tpweave.compile options (a calibration table present, or valid, on some ranks only?)"
    check_ranks_agree(the_plan.agreement(), group=tp.process_group, what=what)


def report(compiled: CompiledTP) -> CompileReport:
    """What the passes did to every graph `compiled` has compiled so far."""
    if not isinstance(compiled, CompiledTP):
        raise ValueError(f"tpweave.report expects what tpweave.compile returned, got {type(compiled).__name__}")
    return compiled.compile_report
