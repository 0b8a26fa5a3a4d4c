"""Started with every Python of a SLURM chaos job whose ``PYTHONPATH`` holds this folder
(tools/slurm/cases.py, the time-limit row): with ``PFC_PACE_S`` set, each training micro-batch
of each rank sleeps that long (seam ``head-loss``, trainer/seams.py), so that the job's steps
last about as long on an idle machine as on a loaded one and SLURM's time-limit signal, which
comes on the controller's 30-second ticks, falls mid-run. The math is untouched: the hook
returns nothing, so the loss is the rank's own."""

import os

if os.environ.get("PFC_PACE_S"):
    import time

    from trainer import seams

    _PACE_S = float(os.environ["PFC_PACE_S"])
    seams.attach("head-loss", lambda loss, rank: time.sleep(_PACE_S))
