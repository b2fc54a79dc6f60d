"""The `[activation]` and `[compile]` sections: what the forward keeps for backward, and whether the units'
forwards are compiled."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from infinity.config.options import ConfigError, Section, option, show


@dataclass(frozen=True, kw_only=True)
class ActivationConfig(Section):
    """What the forward keeps for backward (Note [unit checkpoints] in activations.py)."""

    SECTION: ClassVar[str] = "activation"

    checkpoint: str = option("none", '"units": keep only each unit\'s inputs and recompute its forward in '
                             "backward (one extra forward of compute, activations of one unit at a time); "
                             '"none": keep every activation the forward saves.', "enum", choices=("none", "units"))
    offload: str = option("none", '"host": the units\' saved inputs go to (pinned) host memory after their '
                          "forward and are copied back one unit ahead of their backward; needs checkpoint = \"units\".",
                          "enum", choices=("none", "host"))
    loss_chunk_tokens: int = option(0, "N > 0: a causal LM's output head and cross-entropy run over N tokens at a "
                                    "time in forward and again in backward, so the full [batch, seq, vocab] "
                                    "logits never exist (Hugging Face causal LMs called with labels, or a model "
                                    "with chunked_loss_parts; Note [chunked loss]); 0: off.", "int", ge=0)

    def _check(self) -> None:
        if self.offload != "none" and self.checkpoint == "none":
            raise ConfigError(
                f'activation.offload = {show(self.offload)} moves the units\' saved inputs, which exist only with '
                f'activation.checkpoint = "units" (here "none"); set activation.checkpoint = "units", or remove '
                f"activation.offload")


@dataclass(frozen=True, kw_only=True)
class CompileConfig(Section):
    """torch.compile of the units (Note [compiled units] in runtime/compiled.py; docs/compile.md)."""

    SECTION: ClassVar[str] = "compile"

    units: bool = option(False, "Compile each unit's forward with torch.compile (the root unit's code, the engine's "
                         "hooks, checkpoints and offloads stay outside the compiled code): units of one class share "
                         "one compiled graph. A model compiled whole (torch.compile(model)) is refused: pass the "
                         "model itself and set this.", "bool")
    backend: str = option("inductor", 'torch.compile\'s backend: "inductor" (generated kernels), "aot_eager" '
                          '(the traced graphs run by eager kernels: to tell a compiler problem from a capture '
                          'one), "eager".', "enum", choices=("inductor", "aot_eager", "eager"))
    mode: str = option("default", 'inductor\'s mode: "default", or "max-autotune-no-cudagraphs". The CUDA graph '
                       'modes ("reduce-overhead", "max-autotune") are refused: a CUDA graph replays the addresses '
                       'of the parameters it recorded, which the engine frees after each unit and gathers again '
                       'elsewhere.', "enum",
                       choices=("default", "max-autotune-no-cudagraphs", "reduce-overhead", "max-autotune"))
    fullgraph: bool = option(False, "true: a graph break inside a unit's forward is an error (torch.compile's "
                             "fullgraph), instead of a unit compiled in pieces.", "bool")

    def _check(self) -> None:
        if self.mode in ("reduce-overhead", "max-autotune"):
            raise ConfigError(f'compile.mode = {show(self.mode)} records CUDA graphs, which replay the addresses of '
                              f'the parameters they recorded: the engine frees each unit\'s gathered parameters '
                              f'after use and gathers them again elsewhere; use "default" or '
                              f'"max-autotune-no-cudagraphs"')
        given = [k for k in ("backend", "mode", "fullgraph") if not self._is_default(k)]
        if given and not self.units:
            raise ConfigError(f"compile.{given[0]} = {show(getattr(self, given[0]))} has no effect with "
                              f"compile.units = false (nothing is compiled); set compile.units = true, or remove "
                              f"compile.{given[0]}")
        if self.mode != "default" and self.backend != "inductor":
            raise ConfigError(f"compile.mode = {show(self.mode)} is a mode of the inductor backend, not of "
                              f"compile.backend = {show(self.backend)}; remove compile.mode, or use "
                              f'compile.backend = "inductor"')
