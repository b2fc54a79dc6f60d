"""The compute device and the process group, as the layers above use them: CUDA streams ordered by events and
the host-sync seam (streams.py), collectives as issue/wait handles (collectives.py), the dtype map (dtypes.py).
Imports nothing else of infinity."""
