"""The jobs a lease runs: the verbs by which its agent reports on them, which job a new
placement restarts, and the end reason a job's exit gives the lease."""

from __future__ import annotations

from dataclasses import replace

from domain.errors import IllegalTransition
from domain.jobspec import JobSpec
from domain.lease_guards import LeaseGuards
from domain.lease_values import WORKLOAD_STATES, Job, JobState, LeaseState

S = LeaseState


class LeaseJobs(LeaseGuards):
    """The lease's jobs: one at a time, each started, exited or failed as its agent reports."""

    @property
    def restarts_on_placement(self) -> bool:
        """A requeued lease whose job a preemption interrupted: its next placement restarts
        that job on its own (`commit` without a job) instead of waiting for a commit."""
        return (self.state is S.QUEUED and (self.requeue_on_preemption or self.retrying)
                and self._job_to_restart() is not None)

    def _job_to_restart(self) -> Job | None:
        """The job a preemption interrupted: stopped by it (killed in its grace, or ended by
        the preemption itself), not one that finished cleanly in the meantime."""
        job = self.job
        if job is None or job.is_active:
            return None
        if self.retrying:  # a retry runs the job its last attempt ended with, whatever ended it
            return job
        if job.failure_reason == "preempted":
            return job
        if self.interrupted_job == job.number and not (
                job.state is JobState.EXITED and job.exit_code == 0):
            return job
        return None

    def run_job(self, now: float, job: JobSpec) -> int:
        """Start another job in a running lease whose previous job has ended; returns its number."""
        self._require("run_job", {S.RUNNING})
        self._require_not_past_deadline(now)
        if self.job is not None and self.job.is_active:
            raise IllegalTransition(self.state, "run_job", reasons=("job_active",),
                                    detail=f"job {self.job.number} is still {self.job.state}")
        self._job_submitted(at=float(now), job_number=self.jobs_submitted + 1, spec=job.to_dict())
        return self.jobs_submitted

    def job_started(self, now: float, *, epoch: int) -> None:
        """The agent reports that the current job's process is running."""
        self._require("job_started", WORKLOAD_STATES)
        self._check_epoch(epoch)
        self._require_job("job_started", {JobState.STARTING})
        self._job_started(at=float(now), epoch=epoch)

    def job_exited(self, now: float, *, epoch: int, exit_code: int) -> None:
        """The agent reports that the current job exited with `exit_code`."""
        self._require("job_exited", WORKLOAD_STATES)
        self._check_epoch(epoch)
        self._require_job("job_exited", {JobState.STARTING, JobState.RUNNING})
        self._job_exited(at=float(now), epoch=epoch, exit_code=int(exit_code))

    def job_failed(self, now: float, *, epoch: int, reason: str) -> None:
        """The agent reports that the current job could not run (image pull, OOM kill, ...)."""
        self._require("job_failed", WORKLOAD_STATES)
        self._check_epoch(epoch)
        self._require_job("job_failed", {JobState.STARTING, JobState.RUNNING})
        self._job_failed(at=float(now), epoch=epoch, reason=reason)

    def _require_job(self, verb: str, allowed: set[JobState]) -> None:
        if self.job is None:
            raise IllegalTransition("no_job", verb, reasons=("no_job",))
        if self.job.state not in allowed:
            raise IllegalTransition(f"job_{self.job.state}", verb)

    def _end_job(self, at: float, *, exit_code: int | None = None, failure: str = "") -> None:
        """Close the active job, if any, as the lease stops running it."""
        if self.job is None or not self.job.is_active:
            return
        if exit_code is not None:
            self.job = replace(self.job, state=JobState.EXITED, exit_code=exit_code, ended_at=at)
        else:
            self.job = replace(self.job, state=JobState.FAILED, failure_reason=failure, ended_at=at)


def job_outcome(exit_code: int | None, job: Job | None) -> str:
    """The end reason of a lease released after its work: by its job's exit code, or
    `released` when the holder ended it with no job."""
    code = exit_code if exit_code is not None else (job.exit_code if job is not None else None)
    if code is not None:
        return "succeeded" if code == 0 else "failed"
    if job is not None and job.state is JobState.FAILED:
        return "failed"
    return "released"
