"""``python -m tools.slurm demo`` (``make slurm-demo``): start the two-node SLURM cluster
(tools/slurm/cluster.py), submit the smoke recipe on both nodes with
scripts/slurm/train.sbatch, show ``squeue`` while it runs and ``sacct`` once it ended, stop
the cluster. ``python -m tools.slurm up``: start it and keep it until Ctrl-C, printing the
``SLURM_CONF`` to export for sbatch, squeue, sacct and scontrol in another shell.

Needs root (network namespaces, the daemons) and Debian's slurm-wlm and munge, which it
installs with apt-get where absent.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

from launch.cli import plain_help
from tools.slurm.cluster import ClusterDidNotStart, NoSlurm, cluster

STEPS = 30


def demo(keep: bool) -> int:
    from tools.slurm.cases import CPU, SCRIPT
    from tools.testbed.harness import write_data

    work = Path(tempfile.mkdtemp(prefix="slurm-demo-"))
    data, run = write_data(work / "data"), work / "run"
    with cluster(work / "slurm", keep=keep) as c:
        print(c.run("sinfo"), flush=True)
        cmd = ["sbatch", *CPU, "--nodes=2", f"--output={work}/%x-%j.out", SCRIPT,
               "configs/smoke.yaml", f"data.dir={data}", f"output={run}",
               f"train.max_steps={STEPS}", "train.batch_size=8", "data.num_workers=0"]
        print("$ " + " ".join(cmd), flush=True)
        job = c.sbatch(*cmd[1:], PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}",
                       WANDB_MODE="offline", OMP_NUM_THREADS="1")
        header = []  # squeue's header once, then a line a poll
        while c.state(job) in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING"):
            print(c.run("squeue", *header, "-o", "%.6i %.9P %.10j %.8T %.8M %.6D %R").rstrip(),
                  flush=True)
            header = ["--noheader"]
            time.sleep(5)
        print(c.run("sacct", "--completion", "-j", str(job), "-o",
                    "JobID,JobName,Partition,State,ExitCode,NNodes,NodeList,Start,End"))
        log = next(work.glob(f"*-{job}.out"), None)
        if log is not None:
            print(f"{log}:\n" + "\n".join(log.read_text().splitlines()[-4:]))
        state = c.state(job)
    print(f"job {job}: {state}; run folder {run}")
    return 0 if state == "COMPLETED" else 1


def up(site: bool) -> int:
    with cluster(keep=True, site=site) as c:
        print(c.run("sinfo"), flush=True)
        print(f"export SLURM_CONF={c.work / 'slurm.conf'}   # then sbatch, squeue, sacct -c; "
              "Ctrl-C stops the cluster", flush=True)
        signal.signal(signal.SIGTERM, signal.default_int_handler)  # stops as Ctrl-C does
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.slurm",
                                     description=plain_help(__doc__.split("\n\n")[0]))
    parser.add_argument("command", choices=("demo", "up"))
    parser.add_argument("--keep", action="store_true",
                        help="keep the cluster's folder (logs, slurm.conf) after a demo")
    parser.add_argument("--site", action="store_true",
                        help="up: the site-like cluster (2 CPUs and 2 fake GPUs a node, "
                        "task/affinity)")
    args = parser.parse_args(argv)
    try:
        return demo(args.keep) if args.command == "demo" else up(args.site)
    except (NoSlurm, ClusterDidNotStart) as err:
        print(f"python -m tools.slurm: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
