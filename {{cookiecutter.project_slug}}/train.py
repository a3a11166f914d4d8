"""Train with DistributedDataParallel; resume from the newest good snapshot after any failure.

    # one process (CPU or one GPU)
    python train.py
    # every rank on this machine
    torchrun --standalone --nproc_per_node={{ cookiecutter.nproc_per_node | int }} train.py
    # restart and resume after failures
    torchrun --standalone --nproc_per_node={{ cookiecutter.nproc_per_node | int }} --max-restarts=3 train.py
    # several machines
    torchrun --nnodes=2 --nproc_per_node={{ cookiecutter.nproc_per_node | int }} --rdzv-backend=c10d \
        --rdzv-endpoint=HOST:29400 --rdzv-id=JOB train.py
    # the same, on SLURM
    sbatch scripts/train.sbatch

`python train.py --help` lists every setting. Re-running a command in the same folder resumes from
--snapshot-dir; `--resume never` starts from scratch (moving what the folder holds aside).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import TYPE_CHECKING, cast

from {{ cookiecutter.project_slug }} import config  # no torch in it: --help and a mistyped flag answer at once
from {{ cookiecutter.project_slug }}.machinery import warmstart

warmstart.handoff()  # a torchrun restart: this rank runs in a fork of a process that has imported torch already

if TYPE_CHECKING:
    from {{ cookiecutter.project_slug }}.machinery.report import Summary

log = logging.getLogger("{{ cookiecutter.project_slug }}.train")


def main(argv: list[str] | None = None) -> Summary:
    cfg = config.parse_args(argv)  # before torch loads (2-3 s): a bad command line costs no wait
    from torch.distributed.elastic.multiprocessing.errors import record

    # record: a failing rank's traceback reaches torchrun's summary (it returns what run returns, or raises)
    return cast("Summary", record(run)(cfg))


def run(cfg: config.Config) -> Summary:
    """Train with settings already parsed: set up this rank, train, tear down."""
    from {{ cookiecutter.project_slug }}.machinery import (
        debug,
        debugflags,
        distributed,
        faults,
        logs,
        parentdeath,
        partners,
        stop,
        trainer,
    )
    from {{ cookiecutter.project_slug }}.machinery.snapshot import SnapshotError
    from {{ cookiecutter.project_slug }}.machinery.stream import StreamEnded

    warmstart.serve_restarts()  # local rank 0 of a job that may restart: keep a copy of this process as it is now
    env = distributed.read_env()
    try:
        partner_jobs = partners.for_run(cfg)  # the jobs this one trains with, if any: they may give it files of its own
    except config.RunError as exc:
        print(f"error: {exc}", file=sys.stderr)
        record_cause(exc)
        raise SystemExit(2) from None
    cfg = debugflags.replay_log(cfg)  # --resume-from: a replay logs to a file of its own
    logs.setup(env.rank, cfg.log_file)
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        parentdeath.exit_with_parent()  # a worker whose torchrun agent died stops too, instead of training on alone
    stopped = stop.stopped_by_signal(cfg.snapshot_dir)
    if stopped:  # torchrun restarting a job that a signal stopped: stay stopped, with the same exit code
        logs.warn_from_rank_0(
            log,
            env.is_main,
            "this job was stopped by signal %d: not restarting it; run the same command again to resume",
            stopped,
        )
        sys.exit(128 + stopped)
    finished = False
    try:
        env = distributed.init(env, cfg)
        log.info("rank %d of %d, backend %s, device %s", env.rank, env.world_size, env.backend, env.device)
        summary = trainer.train(cfg, env, partner_jobs)
        finished = True
    except faults.BadUserValue as exc:  # a value of the user's code refused on this rank: the others may not meet it
        failed_here(env, faults.message(exc))
        raise SystemExit(2) from None
    except config.RunError as exc:
        # Every rank meets the same problem: rank 0 says it, in one line, and each rank exits with code 2. torchrun
        # restarts any failed attempt: one that meets the same problem again does not say it again.
        problem = faults.message(exc)
        says = env.is_main and not faults.refused_before(problem)
        log.log(logging.ERROR if says else logging.DEBUG, "%s", problem)
        if env.is_main:
            record_cause(exc)
        raise SystemExit(2) from None
    except (SnapshotError, StreamEnded) as exc:  # this rank's own (a failed save, its stream's end): one line, tagged
        failed_here(env, str(exc))
        raise SystemExit(2) from None
    except faults.PeerFailed as exc:  # another rank failed, and every rank knows which
        log.warning("stopped because %s; %s", exc, logs.restart_note())
        faults.record(f"stopped because {exc}", peer=True)
        raise SystemExit(1) from None
    except SystemExit:
        raise
    except BaseException as exc:
        if logs.lost_peer(exc):  # not this rank's fault: the rank that failed says why
            peer = faults.failed_peer()
            logs.log_failure(log, exc, peer=peer)
            faults.record(f"stopped because {peer or 'it lost another rank'}", peer=True)
            raise SystemExit(1) from None
        if not isinstance(exc, Exception) or type(exc).__name__ == "BdbQuit":  # Ctrl-C, a quit from pdb: one warning
            logs.log_failure(log, exc)
            raise
        line = faults.describe(exc)  # the user's code raised: one line naming their function and line
        told = line or f"{type(exc).__name__}: {exc}".strip()
        shown_by = faults.announce(told, env.rank)  # another rank that failed alike first, if one did
        logs.log_failure(log, exc, line=line, shown_by=shown_by)  # tagged with this rank, the traceback once
        faults.record(told)  # torchrun's summary and launch() show this line, not the traceback a second time
        debug.post_mortem(env, exc)  # DEBUG_POSTMORTEM=1: wait for a debugger, stopped at the exception
        raise SystemExit(1) from None
    finally:
        distributed.teardown(clean=finished)
    code = 128 + summary.stop_signal if summary.stop_signal else 0  # stopped early: not a success, to re-run it
    partner_jobs.end_process(code)  # the run's files are written: a job group may end the process here
    if code:
        sys.exit(code)
    return summary


def failed_here(env, line: str) -> None:
    """This rank's own failure, in one line: shown at ERROR, recorded for torchrun and launch(), and left for the
    ranks that will lose this one (before the process group goes)."""
    from {{ cookiecutter.project_slug }}.machinery import faults

    log.error("%s", line)
    faults.announce(line, env.rank)
    faults.record(line)


def record_cause(exc: BaseException) -> None:
    """Give torchrun (and launch()) the one-line cause of an exit with code 2, as record() does for a traceback."""
    from {{ cookiecutter.project_slug }}.machinery import faults

    faults.record(f"{type(exc).__name__}: {faults.message(exc)}")


if __name__ == "__main__":
    # Exit without the interpreter's last sweep over torch's objects (about 1 s per rank, which torchrun waits for
    # before it restarts a job whose peer died); as usual under a debugger.
    warmstart.run_and_exit(main)
