"""The engine's :class:`~deepinfer_jax.engine.scheduler.Scheduler` on one device, as the policy tests read it.

The scheduling policy is per device (:class:`~deepinfer_jax.engine.scheduler.DeviceScheduler`), and the policy
tests check one device's state step by step. :class:`OneDevice` runs the real engine scheduler with
``num_devices=1`` -- routing, :func:`~deepinfer_jax.engine.plan.build_plan` and result hand-back included -- and
shows each step as device 0's :class:`~deepinfer_jax.engine.plan.PlanView` (with the plan it came from), and
the device scheduler's state (blocks, slots, queues, stats) as its own attributes.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from deepinfer_jax.engine.plan import PlanView, StepPlan
from deepinfer_jax.engine.scheduler import Scheduler


class Step(PlanView):
    """Device 0's part of a step, keeping the :class:`StepPlan` it belongs to (``.plan``)."""

    plan: StepPlan

    @classmethod
    def of(cls, plan: StepPlan) -> Step:
        step = cls(*plan.view(0))
        step.plan = plan
        return step

    @property
    def max_blocks_per_seq(self) -> int:
        return int(self.block_tables.shape[1])

    @property
    def requests(self) -> list[Any]:
        """The requests of the real rows, in row order."""
        batch = self.plan.batches[0]
        return [] if batch is None else batch.requests


class OneDevice:
    """``Scheduler(num_devices=1, **kwargs)`` with device 0's view (module docstring)."""

    def __init__(self, **kwargs: Any) -> None:
        self.engine = Scheduler(**kwargs)
        self.device = self.engine.devices[0]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.device, name)

    def add_request(self, *args: Any, **kwargs: Any) -> int:
        return self.engine.add_request(*args, **kwargs)

    def get_request(self, request_id: str) -> Any:
        return self.engine.get_request(request_id)

    def schedule(self) -> Step | None:
        plan = self.engine.schedule()
        return None if plan is None else Step.of(plan)

    def process_outputs(self, step: Step, tokens: Any, **arrays: Any) -> list:
        """``step``'s results for device 0 (``[S]`` arrays, ``prompt_logprobs`` a tuple of ``[T]`` arrays)."""
        lifted = {
            k: None
            if v is None
            else (tuple(np.asarray(a)[None] for a in v) if k == "prompt_logprobs" else np.asarray(v)[None])
            for k, v in arrays.items()
        }
        return self.engine.process_outputs(step.plan, np.asarray(tokens)[None], **lifted)
