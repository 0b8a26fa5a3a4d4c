"""Started with every Python of a SLURM chaos job whose ``PYTHONPATH`` holds this folder
(tools/slurm/cases.py, tools/slurm/site_cases.py); each hook only where its variable is set,
and only in the ranks (torchrun's workers, which have ``LOCAL_RANK``):

- ``PFC_PACE_S``: each training micro-batch sleeps that long (seam ``head-loss``,
  trainer/seams.py), so that the job's steps last about as long on an idle machine as on a
  loaded one and SLURM's time-limit signal, which comes on the controller's 30-second ticks,
  falls mid-run. The math is untouched: the hook returns nothing, so the loss is the rank's.
- ``PFC_AFFINITY_DIR``: the rank writes the CPUs it may run on (``os.sched_getaffinity``),
  its ``CUDA_VISIBLE_DEVICES`` and, where ``PFC_GPU_DIR`` names the cluster's folder, what
  opening each of its node's fake GPU device files gave (``nvidia0:ENXIO``: the devices
  cgroup let it through to a device no driver serves; ``EPERM``: denied; ``ok``: a plain
  file) into ``DIR/<node>-<local rank>``, one line each: what SLURM gave its task.
- ``PFC_FAIL_FIRST_RUN``: in the job's first run (``SLURM_RESTART_COUNT`` unset or 0) the
  rank exits 3 at its end, whatever it did: trainers that fail while being preempted.
"""

import os

if "LOCAL_RANK" in os.environ:
    if os.environ.get("PFC_PACE_S"):
        import time

        from trainer import seams

        _PACE_S = float(os.environ["PFC_PACE_S"])
        seams.attach("head-loss", lambda loss, rank: time.sleep(_PACE_S))
    if os.environ.get("PFC_AFFINITY_DIR"):
        import errno
        import glob

        def _opened(path):
            try:
                os.close(os.open(path, os.O_RDONLY))
                return "ok"
            except OSError as err:
                return errno.errorcode.get(err.errno, str(err.errno))

        _gpus = sorted(glob.glob(os.path.join(os.environ.get("PFC_GPU_DIR", "/nonexistent"),
                                              f"dev-{os.environ.get('SLURMD_NODENAME')}", "*")))
        _name = f"{os.uname().nodename}-{os.environ['LOCAL_RANK']}"
        with open(os.path.join(os.environ["PFC_AFFINITY_DIR"], _name), "w") as _out:
            _out.write(" ".join(map(str, sorted(os.sched_getaffinity(0)))) + "\n"
                       + os.environ.get("CUDA_VISIBLE_DEVICES", "-") + "\n"
                       + " ".join(f"{os.path.basename(p)}:{_opened(p)}" for p in _gpus) + "\n")
    if os.environ.get("PFC_FAIL_FIRST_RUN") and os.environ.get("SLURM_RESTART_COUNT", "0") == "0":
        import atexit

        atexit.register(os._exit, 3)
