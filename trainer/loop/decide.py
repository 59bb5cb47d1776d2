"""What follows a training step, decided in one place: `StepEnds.decide`.

Each component keeps its own schedule and says whether it is due: the logging cadence
(`logs`), `Evaluator.due`, `CheckpointManager.due`, the callbacks' requests (made in their
hooks), eval_every_minutes (`Evaluator.time_is_up`) and stop signals. `decide` asks them all,
makes the step's one cross-rank agreement (`Agreement.exchange`) and the one non-finite watch
(`NonFiniteWatch.check`, before any value is logged, evaluated or saved), and returns what the
loop does. What a component says is due happens, unless the decision says why not: a
non-finite value stops the run first.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from ringtrain.callbacks.base import Callbacks, Run, StepEnd
from ringtrain.checkpoints.manager import CheckpointManager
from ringtrain.loop.evaluation import Evaluator
from ringtrain.loop.nonfinite import NonFiniteWatch
from ringtrain.loop.signals import Agreement, StopSignals

log = logging.getLogger("ringtrain")
NONFINITE = "non-finite"


@dataclass(frozen=True)
class Decision:
    """What the loop does after a step: save (`best`: as best.pt too), then stop or go on."""

    save: bool = False
    best: bool = False
    # Why the run stops here ("SIGTERM", "non-finite", a callback's reason such as early
    # stopping's), and the kind of stop: "signal", "non-finite" or "requested" (FitResult).
    stop: str | None = None
    stop_kind: str | None = None


@dataclass
class StepEnds:
    """The components that decide what follows each step of one run (loop/fit.py makes it)."""

    trainer: Any
    run: Run
    callbacks: Callbacks
    evaluator: Evaluator
    checkpoints: CheckpointManager
    nonfinite: NonFiniteWatch
    agreement: Agreement
    stop: StopSignals

    def logs(self, step: int) -> bool:
        """The logging cadence: every trainer.log_every_n_steps, and the last step. Asked before
        the update too, which measures the gradient norm only where it is logged (or watched)."""
        return step % self.trainer.log_every_n_steps == 0 or step == self.run.total_steps

    def before_training(self) -> Decision:
        """Before the first step (after on_fit_start): a callback's stop (a run resumed from the
        checkpoint of early stopping's last step), a signal during set-up on any rank (agreed at
        once, so no rank trains), or a finished run started again, which validates only."""
        run, step = self.run, self.run.step
        if run.control.stop_reason:
            log.info(f"stopped by {run.control.stop_reason} before training step {step + 1}")
            return Decision(stop=run.control.stop_reason, stop_kind="requested")
        if self.agreement.agree_now(self.stop.poll(step)):
            stopped = self.stop.received or "a stop signal on another rank"
            log.info(f"stopped by {stopped} before training step {step + 1}; nothing new to save"
                     + (f": the checkpoint it resumed from (step {step}) is where the run stands" if step else ""))
            return Decision(stop=stopped, stop_kind="signal")
        if step >= run.total_steps:  # a requeue, the same command
            self.evaluator.validate(run, self.callbacks)
            log.info(f"nothing to train: the checkpoint is at step {step} of {run.total_steps} (raise "
                     f"trainer.max_steps or trainer.max_epochs to continue)")
        return Decision()

    def decide(self, end: StepEnd, position: int, epoch_done: bool) -> Decision:
        """After step `end.step` (which brought the epoch to `position`): calls on_step_end with
        what the schedules made due, agrees what any rank asked, validates when that is due
        (what callbacks do then, early stopping's stop, is part of the decision) and says
        whether to save and whether to stop."""
        run, step = self.run, end.step

        def stops_nonfinite(grad_norm: Any) -> bool:
            """on_nonfinite=stop: a value about to be logged, evaluated or saved is checked first."""
            if not self.nonfinite.check(step, grad_norm):
                return False
            if run.dist.is_main:
                log.error(self.nonfinite.stop_message(step, self.checkpoints.last))
            run.metrics = {run.task.monitor: float("nan")}
            return True

        validate = self.evaluator.due(step, position, epoch_done)
        saving = self.checkpoints.due(step, validate, last=step == run.total_steps)
        if (end.logging or validate or saving) and stops_nonfinite(end.grad_norm):
            return Decision(stop=NONFINITE, stop_kind=NONFINITE)
        end.due = {name for name, due in (("validate", validate), ("save", saving)) if due}
        self.callbacks.call("on_step_end", run, end)
        # What was asked: by callbacks now, and by any rank a step ago (a stop signal, a rank-0
        # callback, eval_every_minutes), which every rank now agrees on.
        local, run.control.local = run.control.local, {}
        agreed = self.agreement.exchange(
            stop_signal=self.stop.poll(step), stop_request=bool(local.get("stop_reason")),
            validate=bool(local.get("validate")) or self.evaluator.time_is_up(), save=bool(local.get("save")))
        if (run.control.validate or agreed["validate"]) and not validate:
            validate = True
            if stops_nonfinite(end.grad_norm):
                return Decision(stop=NONFINITE, stop_kind=NONFINITE)
        best = self.evaluator.validate(run, self.callbacks) if validate else False
        stop = kind = None
        if run.control.stop_reason or agreed["stop_request"]:  # the run is done: a signal now changes nothing
            stop, kind = run.control.stop_reason or local.get("stop_reason") or "a callback on rank 0", "requested"
        elif agreed["stop_signal"]:
            stop, kind = self.stop.received or "a stop signal on another rank", "signal"
            self.callbacks.call("on_stop_signal", run, stop)
        save = bool(self.trainer.checkpoint and (saving or validate or stop or run.control.save or agreed["save"]))
        if save and not saving and not validate and stops_nonfinite(None):
            return Decision(stop=NONFINITE, stop_kind=NONFINITE)
        run.control.validate = run.control.save = False
        return Decision(save=save, best=best, stop=stop, stop_kind=kind)
