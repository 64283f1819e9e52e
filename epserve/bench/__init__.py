"""The benchmark's CPU side: layer presets and routings, the arithmetic of what a layer must
compute and move (and so the fastest it could run), timing summaries, nccl-tests-style tables
and JSON, plots and a sweep progress bar. The GPU measurements feed into it from launch/jobs.

Importing this package needs only NumPy; plots.py imports matplotlib when it draws."""
