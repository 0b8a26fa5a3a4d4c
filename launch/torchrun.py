"""``python -m launch.torchrun [torchrun arguments]``: torchrun whose exit code survives a
preemption. ``make train``, ``make <recipe>`` and scripts/slurm/train.sbatch start the ranks
with it; its arguments are torchrun's, unchanged.

Plain torchrun turns SIGTERM into a ``SignalException``: it sends SIGTERM to each rank's
whole process group (the rank and its DataLoader workers), waits for them and exits 1 with a
traceback whatever the ranks did; SIGUSR1 kills it outright (rc 138, its ranks orphaned).
A scheduler then records a failed job after a clean save (torch 2.13, measured).

This program runs torchrun (``torch.distributed.run``) in its own process with SIGTERM,
SIGUSR1 and SIGINT taken from it: each one it receives is passed on to every rank's own
process, never to the rank's group, so a loader worker meets a job-wide signal once, which
it outlives (``data_pipeline.loader``); a rank that gets the same signal twice (from the
scheduler or the terminal, and from here) counts it once. The ranks save at the next step
boundary and exit 0 (``trainer.preemption``), and torchrun, which never saw the signal,
exits as its ranks did: 0 when every rank saved and exited 0, its usual non-zero code (or
a restart, with ``--max-restarts``) when one failed or was killed. No state outlives the
launch, so an earlier launch's save cannot explain away this one's failure. Ctrl-C is a
stop like SIGTERM; a second one, or a stop signal the step's end is too far away for, ends
the job at once (``trainer.preemption``). SIGHUP and SIGQUIT stay torchrun's.

Signals that arrive while no rank runs (rendezvous, a restart) reach no rank.

A c10d rendezvous (``--rdzv-backend c10d``, as an elastic ``--nnodes MIN:MAX`` launch uses)
gets the settings torchrun leaves to the user and that a node leaving or joining needs: the
store's host, this node's address, a store per incarnation (``launch.rendezvous``).

A failed rank (the launch's restarts spent) ends the launch with one line instead of
torchrun's ``ChildFailedError`` block, which repeated, below the rank's own one-line error,
a traceback of the launcher: which rank failed first, its exit code and where the record is
(``RUN/train.log``, which receives torchrun's full report and its agent's log lines). The
launch exits with that
rank's code: 2 when it refused its input, 1 for a runtime failure or a rank killed by a
signal.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

FORWARDED = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


def rank_pids(parent: int) -> list[int]:
    """The rank processes torchrun (process ``parent``) started: its children with a
    ``LOCAL_RANK`` in their environment (read from /proc)."""
    pids = []
    for children in Path(f"/proc/{parent}/task").glob("*/children"):
        for pid in children.read_text().split():
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes()
            except OSError:  # ended meanwhile
                continue
            if b"\0LOCAL_RANK=" in b"\0" + environ:
                pids.append(int(pid))
    return pids


def forward(signum: int, frame) -> None:
    """Signal handler: pass ``signum`` on to each rank process of this torchrun."""
    for pid in rank_pids(os.getpid()):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)


def run_folder(args) -> str | None:
    """The run folder of the ``launch.train`` this torchrun starts (``-m launch.train
    --config FILE key=value ...``; a path or a URL), None for another program or an
    unreadable recipe."""
    if not args.module or args.training_script != "launch.train":
        return None
    from launch.train import parse_args
    from trainer.config import run_folder as folder_of

    try:
        script = parse_args(args.training_script_args)
    except SystemExit:  # its usage error, which the ranks printed
        return None
    return folder_of(script.config, script.overrides)


class AgentLog(logging.Handler):
    """torchrun's agent log (``torch.distributed.elastic``: "Sending process N closing signal",
    "failed (exitcode: 2) local_rank: 1 ...") and its failure report, kept for the run's
    train.log instead of stderr. Lines wait in memory while the run folder does not exist
    (a refused config makes none)."""

    def __init__(self, run_dir: Path):
        super().__init__()
        self.run_dir = run_dir
        self.pending: list[str] = []
        self.setFormatter(logging.Formatter("torchrun %(levelname)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        self.add(self.format(record))

    def add(self, text: str) -> None:
        from trainer.telemetry.console import append_log

        self.pending.append(text)
        if self.run_dir.is_dir():
            append_log(self.run_dir, "\n".join(self.pending))
            self.pending.clear()


def report_failure(err: ChildFailedError, log: AgentLog | None) -> int:
    """One line on stderr for the first rank that failed, torchrun's full report in the
    run's train.log. With no run folder: nothing more for a refused input (the rank's own
    line said it all, nothing started), else the report as torchrun prints it. Returns the
    launch's exit code: the rank's own, 1 when a signal killed it."""
    from trainer.telemetry.console import LOG_FILE

    rank, failure = err.get_first_failure()
    code = failure.exitcode
    how = f"exit code {code}" if code > 0 else f"killed by {_signal_name(-code)}"
    line = f"launch: rank {rank} (pid {failure.pid}) ended the job with {how}"
    report = f"launch.torchrun: torchrun's report\n{err.format_msg()}"
    if log is not None:
        log.add(report)
    if log is not None and not log.pending:
        line += f"; torchrun's report is in {log.run_dir / LOG_FILE}"
    elif code == 2:
        line += " (its input was refused; nothing started)"
    else:
        print("\n".join(log.pending if log is not None else [report]), file=sys.stderr)
    print(line, file=sys.stderr)
    return code if code > 0 else 1


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def main(argv: list[str] | None = None) -> int:
    """torchrun on ``argv``; returns 0, or the failed rank's exit code (one line printed)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    from data_pipeline.store import StorageError, local_path
    from launch.rendezvous import complete as complete_rendezvous
    from trainer.errors import EXIT_STATUS
    from trainer.folder_lock import open_lock

    parser = get_args_parser()
    parser.prog = "python -m launch.torchrun"
    parser.description = ("torchrun (same arguments) whose SIGTERM, SIGUSR1 and SIGINT go to "
                          "each rank, which saves and exits 0: the launch then exits 0, not 1 "
                          "(a second signal stops the ranks at once). A failed "
                          "rank ends it with one line (rank, exit code, RUN/train.log) and its "
                          f"exit code. {EXIT_STATUS}.")
    torchruns_help = parser.format_help  # reST in places: --help reads as plain text
    parser.format_help = lambda: torchruns_help().replace("``", "")
    args = parser.parse_args(argv)
    if not hasattr(args, "signals_to_handle"):
        raise SystemExit("python -m launch.torchrun: this torch's torchrun has no "
                         "--signals-to-handle to leave SIGTERM/SIGUSR1 to the ranks; use "
                         "torchrun (it exits 1 after a preemption)")
    # torchrun's --signals-to-handle (default SIGTERM,SIGINT,SIGHUP,SIGQUIT) less ours
    args.signals_to_handle = ",".join(
        name for name in args.signals_to_handle.split(",")
        if name.strip() not in {sig.name for sig in FORWARDED})
    note = complete_rendezvous(args)  # a c10d rendezvous: what elastic launches need
    if note:
        print(note, file=sys.stderr, flush=True)
    for sig in FORWARDED:
        signal.signal(sig, forward)
    location = run_folder(args)
    # another job's folder: this launch's report stays on stderr, out of that job's train.log
    try:
        theirs = location is not None and open_lock(location).probe() is not None
    except StorageError:  # a store out of reach: the ranks' own checks say so
        theirs = False
    log = None if location is None or theirs else AgentLog(local_path(location))
    if log is not None:
        agent = logging.getLogger("torch.distributed.elastic")
        agent.addHandler(log)
        agent.propagate = False
    try:
        run(args)
    except ChildFailedError as err:
        return report_failure(err, log)
    if log is not None and log.pending:  # the run never made its folder
        print("\n".join(log.pending), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
