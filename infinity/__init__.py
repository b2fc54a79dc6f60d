"""infinity: out-of-core ZeRO stage-3 training over GPU, pinned RAM and NVMe tiers.

    engine = infinity.initialize(model, infinity.Config.from_file("run.toml"))
    loss = engine(x, y); engine.backward(loss); engine.step()
"""

from infinity.config.sections import Config, ConfigError
from infinity.machine.preflight import PreflightError
from infinity.memory.placement import PlacementError
from infinity.memory.tier import Kind, Tier
from infinity.runtime.engine import Engine, NonFiniteGradError, initialize
from infinity.runtime.materialize import meta_init

__all__ = ["Config", "ConfigError", "Engine", "Kind", "NonFiniteGradError", "PlacementError", "PreflightError",
           "Tier", "initialize", "meta_init"]
__version__ = "0.1.0"
