"""What the fault cases (``tools/chaos``) and the SLURM cluster (``tools/slurm``) both stand on:
``harness`` runs the trainer, injects a fault through a seam and reads what the run did;
``nodes`` makes two network-namespaced "nodes" on one machine."""
