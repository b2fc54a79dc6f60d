"""infinity: out-of-core ZeRO stage-3 training over GPU, pinned RAM and NVMe tiers.

    engine = infinity.initialize(model, infinity.Config.from_file("run.toml"))
    loss = engine(x, y); engine.backward(loss); engine.step()

Note [light package import]: the package's names load on first use (PEP 562), so `import infinity.config` or
`infinity --help` does not import torch (~1.3 s): the `infinity` command parses its arguments, prints `config
--defaults` and catches a Ctrl-C before torch loads (infinity/job/cli.py), and the config's contract in
pyproject.toml ("imports no torch") holds at run time, not only among its own imports. `io_engine/__init__.py`
loads its names the same way.
"""

from __future__ import annotations

import importlib

_HOMES = {"Config": "infinity.config.sections", "ConfigError": "infinity.config.sections",
          "SettingWarning": "infinity.config.sections",
          "PreflightError": "infinity.machine.preflight", "PlacementError": "infinity.memory.placement",
          "Kind": "infinity.memory.tier", "Tier": "infinity.memory.tier", "Engine": "infinity.runtime.engine",
          "NonFiniteGradError": "infinity.runtime.engine", "initialize": "infinity.runtime.engine",
          "meta_init": "infinity.runtime.materialize"}

__all__ = sorted(_HOMES)
__version__ = "0.1.0"


def __getattr__(name: str):
    """A public name, imported from its home module on first use (Note [light package import])."""
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'infinity' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOMES])
