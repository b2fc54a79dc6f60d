"""infinity: out-of-core ZeRO stage-3 training over GPU, pinned RAM and NVMe tiers.

    engine = infinity.initialize(model, infinity.Config.from_file("run.toml"))
    loss = engine(x, y); engine.backward(loss); engine.step()
"""

from .config import Config, ConfigError
from .engine import Engine, NonFiniteGradError, initialize
from .materialize import meta_init
from .memory.placement import PlacementError
from .memory.tier import Kind, Tier
from .preflight import PreflightError

__all__ = ["Config", "ConfigError", "Engine", "Kind", "NonFiniteGradError", "PlacementError", "PreflightError",
           "Tier", "initialize", "meta_init"]
__version__ = "0.1.0"
