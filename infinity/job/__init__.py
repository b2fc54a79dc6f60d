"""The `infinity` command and its job: CLI (cli.py), the train job and its spec (train.py, spec.py), resume, the
run directory, progress, data, and the reports (estimate.py, scaling.py). Nothing below imports this package."""
