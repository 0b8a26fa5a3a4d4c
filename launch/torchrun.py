"""``python -m launch.torchrun [torchrun arguments]``: torchrun whose exit code survives a
preemption. ``make train``, ``make <recipe>`` and scripts/slurm/train.sbatch start the ranks
with it; its arguments are torchrun's, unchanged.

Plain torchrun turns SIGTERM into a ``SignalException``: it sends SIGTERM to each rank's
whole process group (the rank and its DataLoader workers), waits for them and exits 1 with a
traceback whatever the ranks did; SIGUSR1 kills it outright (rc 138, its ranks orphaned).
A scheduler then records a failed job after a clean save (torch 2.13, measured).

This program runs torchrun (``torch.distributed.run``) in its own process with SIGTERM and
SIGUSR1 taken from it: each one it receives is passed on to every rank's own process, never
to the rank's group, so a loader worker meets a job-wide signal once, which it outlives
(``data_pipeline.loader``). The ranks save at the next step boundary and exit 0
(``trainer.preemption``), and torchrun, which never saw the signal, exits as its ranks did:
0 when every rank saved and exited 0, its usual non-zero code (or a restart, with
``--max-restarts``) when one failed or was killed. No state outlives the launch, so an
earlier launch's save cannot explain away this one's failure. SIGINT, SIGHUP and SIGQUIT
stay torchrun's: Ctrl-C ends the job at once, as before.

Signals that arrive while no rank runs (rendezvous, a restart) reach no rank.
"""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

FORWARDED = (signal.SIGTERM, signal.SIGUSR1)


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


def main(argv: list[str] | None = None) -> int:
    """torchrun on ``argv``; returns 0 or raises what torchrun raises (its exit 1)."""
    from torch.distributed.elastic.multiprocessing.errors import record
    from torch.distributed.run import get_args_parser, run

    parser = get_args_parser()
    parser.prog = "python -m launch.torchrun"
    parser.description = ("torchrun (same arguments) whose SIGTERM and SIGUSR1 go to each rank, "
                          "which saves and exits 0: the launch then exits 0, not 1.")
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
    for sig in FORWARDED:
        signal.signal(sig, forward)
    record(run)(args)  # a failed rank: ChildFailedError and its report, as torchrun
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
