"""Guard-plan files from the user: ``load_guard_plan`` (a path, checked), which policy a plan guards
(``plan_for``, ``check_plan_policy``) and its JSON-able view for reports (``guard_plan_summary``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from fp4vis.patching import GuardPlan, GuardPlanError
from fp4vis.policy import Policy, get_policy
from fp4vis.services.usage import UsageError


def load_guard_plan(path: str | os.PathLike | None) -> Any:
    """Load a GuardPlan JSON written by ``fp4vis calibrate`` (None passes through)."""
    if path is None:
        return None
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"guard plan: file {str(path)!r} does not exist (write one with `fp4vis calibrate`)")
    try:
        return GuardPlan.load(p)
    except GuardPlanError as exc:
        raise UsageError(str(exc)) from None


def plan_for(plan: Any, policy: str | Policy) -> Any:
    """The guard plan where it was calibrated for ``policy`` (by name), else None: an eval over several
    policies guards only the one its plan protects (the plan's thresholds are that policy's range)."""
    if plan is None:
        return None
    return plan if get_policy(policy).name == plan.policy.name else None


def check_plan_policy(plan: Any, policy: str | Policy, option: str = "--guard-plan") -> None:
    """A single-policy run (generate) with a plan calibrated for another policy is a user error."""
    if plan is not None and get_policy(policy).name != plan.policy.name:
        raise UsageError(f"{option}: the plan was calibrated for policy {plan.policy.name!r}, not "
                         f"{get_policy(policy).name!r}: pass that policy, or calibrate for this one")


def guard_plan_summary(plan: Any) -> Any:
    """A JSON-able view of a guard plan for sidecars and reports."""
    if plan is None:
        return None
    for attr in ("to_dict", "as_dict"):
        if hasattr(plan, attr):
            return getattr(plan, attr)()
    import dataclasses

    if dataclasses.is_dataclass(plan):
        return dataclasses.asdict(plan)
    return str(plan)
