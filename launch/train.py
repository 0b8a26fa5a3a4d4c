"""``python -m launch.train --config FILE [key=value ...]``: the one training entry point.

Single process: ``python -m launch.train --config configs/smoke.yaml``. Several ranks:
``torchrun --nproc_per_node N -m launch.train ...``; several nodes: ``torchrun --nnodes M
--node_rank i --rdzv_backend c10d --rdzv_endpoint HOST:PORT ...`` (or ``make <recipe>``).
The config is loaded and validated (schema, data manifest, device) before any process
group starts. The run folder (``output``, default ``runs/<name>``) receives config.yaml,
metrics.jsonl, histograms.jsonl, train.log, summary.json, checkpoints/, W&B files (wandb/)
and TensorBoard events (tb/); ``python -m launch.report RUN`` plots it. An existing
checkpoint there is resumed from (``checkpoint.resume=auto``), on any number of ranks; a run
that has finished says so and exits.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

from trainer.config import (
    Config,
    ConfigError,
    ConfigWarning,
    Machine,
    describe_keys,
    dump_config,
    load_config,
    machine_notes,
)
from trainer.dist import DistEnv, init_distributed, shutdown
from trainer.errors import EXIT_STATUS, Refused, yield_to_reporter
from trainer.failures import report_failure
from trainer.folder_lock import open_lock, run_folder_lock
from trainer.host_heap import keep_freed_blocks
from trainer.loop import train
from trainer.preemption import LAUNCHER_WATCH, Interrupted
from trainer.run_store import mirrored
from trainer.stopping import StopRequests
from trainer.telemetry.console import append_log
from trainer.telemetry.logger import print_main

LAUNCHER_GRACE_S = 20.0  # beyond dist.timeout_s, how long a rank may outlive its launcher


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m launch.train",
        description="Train a face-embedding backbone with a sharded margin-softmax head.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Overrides are dotted keys of the schema below, values in YAML syntax, e.g.\n"
        "  margin.type=cosface margin.m=0.35 optim.lr=0.05 eval.bins=[lfw.bin,cfp_fp.bin]\n"
        "key=null gives a key that cannot be null its default back (e.g. over a run folder's "
        "config.yaml,\nwhich spells out every key).\n"
        "Recipes: configs/*.yaml (a recipe holds only differences from these defaults).\n\n"
        "config keys (key: type = default):\n" + describe_keys() + "\n\n" + EXIT_STATUS,
    )
    parser.add_argument("--config", required=True, help="YAML recipe (may say base: FILE)")
    parser.add_argument(
        "--print-config", action="store_true", help="print the resolved config and exit"
    )
    parser.add_argument(
        "--check", action="store_true", help="validate the config against the data and this "
        "machine for a launch of --nproc-per-node x --nnodes ranks, start nothing, and exit "
        "(0, or 2 with the problems): what `make <recipe>` runs before torchrun, so a config "
        "error is printed once instead of once per torchrun restart"
    )
    parser.add_argument("--nproc-per-node", default="1", metavar="N|gpu",
                        help="--check: ranks per node, as torchrun's --nproc_per_node")
    parser.add_argument("--nnodes", dest="node_counts", type=node_counts, default=range(1, 2),
                        metavar="N|MIN:MAX", help="--check: nodes, as torchrun's --nnodes; an "
                        "elastic MIN:MAX is checked for every node count in it")
    parser.add_argument("--errors-only", action="store_true",
                        help="--check: print no warnings (the run that follows prints them)")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    # Options and overrides in any order (`make train ARGS="--config X output=Y"` follows
    # the Makefile's own overrides; the last --config wins).
    return parser.parse_intermixed_args(argv)


def node_counts(text: str) -> range:
    """torchrun's ``--nnodes`` (``N`` or ``MIN:MAX``) as the node counts the launch may have."""
    low, _, high = text.partition(":")
    try:
        counts = range(int(low), int(high or low) + 1)
    except ValueError:
        counts = range(0)
    if not counts or counts[0] < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not N or MIN:MAX nodes (0 < MIN <= MAX)")
    return counts


def launch_machine(nproc_per_node: str, nnodes: int, here: Machine) -> Machine | str:
    """``here`` (this machine) for the launch torchrun will start with ``--nproc_per_node
    nproc_per_node --nnodes nnodes``, or one line saying why torchrun could not start it."""
    if nproc_per_node == "gpu":
        if here.gpus == 0:
            return ("NPROC_PER_NODE=gpu: no GPU on this machine; give NPROC_PER_NODE=<ranks>, "
                    "and device=cpu to train on the CPU")
        return here.launching(here.gpus, nnodes)
    if nproc_per_node.isdigit() and int(nproc_per_node) > 0:
        return here.launching(int(nproc_per_node), nnodes)
    return f"NPROC_PER_NODE={nproc_per_node}: a number of ranks per node, or gpu"


def _print_once_per_node(message: str) -> None:
    """Before any process group: every rank of a node found the same, one report per node,
    from its local rank 0, which the others let exit first."""
    if os.environ.get("LOCAL_RANK", "0") == "0":
        print(message, file=sys.stderr, flush=True)
    else:
        yield_to_reporter()


def main(argv: list[str] | None = None, *, keep_host_heap: bool = False) -> int:
    """The program; ``keep_host_heap``: on a CPU run, keep this process's freed heap blocks
    for reuse (:mod:`trainer.host_heap`: no page faults per step, resident memory at its
    peak). The program itself passes True; an in-process caller keeps glibc's defaults
    unless it asks, since the setting lasts as long as the process."""
    args = parse_args(argv)
    try:
        if not args.check:
            return _main(args, keep_host_heap)
        for nnodes in args.node_counts:  # an elastic launch runs on any count in its range
            code = _main(argparse.Namespace(**vars(args), nnodes=nnodes,
                                            elastic=len(args.node_counts) > 1))
            if code:
                return code
        return 0
    except KeyboardInterrupt:  # Ctrl-C outside the step loop (start-up, the last save)
        print("error: interrupted by SIGINT outside the step loop; the last checkpoint stays: "
              "run the same command again to resume from it", file=sys.stderr)
        return Interrupted.exit_code


def _main(args: argparse.Namespace, keep_host_heap: bool = False) -> int:
    machine = Machine.observe()  # the one look at this machine and torchrun's launch
    if args.check:  # the launch being checked, before torchrun starts it
        shape = launch_machine(args.nproc_per_node, args.nnodes, machine)
        if isinstance(shape, str):
            print(f"launch error: {shape}", file=sys.stderr)
            return 2
        machine = shape
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ConfigWarning)
            # --print-config works before the data exists: what the data and the machine
            # decide (manifest, CUDA, files) is reported as notes instead of refused.
            cfg = load_config(args.config, args.overrides, resolve=not args.print_config,
                              machine=machine)
            notes: list[str] = []
            if args.print_config:
                cfg, notes = machine_notes(cfg, machine)
    except ConfigError as err:  # every rank found the same: one report per node
        _print_once_per_node(f"config error:\n{err}")
        return err.exit_code
    for w in caught if not args.errors_only else ():
        print_main(f"warning: {w.message}")
    # before torchrun: a folder another job holds is refused now; an elastic launch's node
    # may join its own job, which holds it (a second job is refused by its rank 0)
    if args.check:
        refusal = open_lock(cfg.run_location).probe() \
            if cfg.output_lock and not (args.print_config or args.elastic) else None
        if refusal:
            print(f"launch error: {refusal}", file=sys.stderr)
        return 2 if refusal else 0
    if args.print_config:
        for note in notes:
            print(f"note: {note} (training would refuse this)", file=sys.stderr)
        print(dump_config(cfg), end="")
        return 0
    # torchrun's ranks stop when it dies: a checkpoint at the next step boundary, or an
    # exit within the process group's timeout when the group no longer works
    LAUNCHER_WATCH.start(cfg.dist.timeout_s + LAUNCHER_GRACE_S)
    try:
        env = init_distributed(cfg.device, cfg.dist.timeout_s)
    except ConfigError as err:  # this node's network set-up (no interface to the others)
        _print_once_per_node(f"config error: {err}")
        return err.exit_code
    if keep_host_heap and env.device.type == "cpu":
        keep_freed_blocks()  # before the loader forks its workers, which inherit it
    try:
        return run(cfg, env, [str(w.message) for w in caught])
    finally:
        shutdown()


def run(cfg: Config, env: DistEnv, warned: list[str]) -> int:
    """Train ``cfg`` on ``env``'s ranks (collective; the process group is up) holding its
    run folder, mirrored to its store if it has one; ``warned``: the config's warnings, for
    train.log. Returns the exit status; every failure is reported once, here."""
    try:
        stops = StopRequests()  # the run's one holder: lock, signal handlers, steps
        # one job per run folder; a folder in a store is this node's copy, mirrored there
        with run_folder_lock(cfg.run_location, cfg.run_dir, env, stops, cfg.output_lock), \
                mirrored(cfg.run_location, cfg.run_dir, env):
            try:
                if env.is_main:
                    for message in warned:  # train.log keeps what the console said
                        append_log(cfg.run_dir, f"warning: {message}")
                train(cfg, env, stops)
            except Exception as err:  # noqa: BLE001 - reported inside: the mirror uploads it
                return report_failure(err, env.rank, cfg.run_dir)
    except Exception as err:  # noqa: BLE001 - every failure ends here, reported once
        # a refused job writes nothing into the folder of the job that holds it
        logged = None if isinstance(err, Refused) else cfg.run_dir
        return report_failure(err, env.rank, logged)
    return 0


def exit_now(code: int) -> None:
    """End the process with ``code`` once the run is over, skipping interpreter teardown:
    gloo's and DeepSpeed's C++ threads can abort it (``terminate called without an active
    exception``, SIGABRT) after the process group is gone, in a few percent of runs, which
    turns a finished run into a failed one for torchrun and the scheduler. Everything the
    run writes is closed by then; only the standard streams need flushing."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main(keep_host_heap=True))
