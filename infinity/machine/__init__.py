"""The machine the engine runs on: the process environment and group (environment.py), measured link rates
(link_rates.py), and the checks made before any work (preflight.py)."""
