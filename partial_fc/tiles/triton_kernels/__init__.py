"""The Triton kernels of ``partial_fc.tiles.triton``, one module per pass: the forward's row
statistics (:mod:`.forward`), the backward's ``dL/dcos`` tiles (:mod:`.dcos`) and its two GEMMs,
``grad_e`` and the weight gradient (:mod:`.gemm`); the tile operations they (and
``partial_fc.tiles.cublas``' epilogues) share are in :mod:`.tile_ops`.

Nothing here imports triton: ``partial_fc.tiles.triton``, which launches them, imports it
first and names the fix when it is missing.
"""
