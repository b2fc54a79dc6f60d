"""Where the engine is in its gradient accumulation window: which backward ends it, and whether step() acts.

Note [accumulation windows]: an update applies the gradients of one window of `[train] grad_accum_steps`
backward passes. The backward that ends a window is known before it runs (stage 0-1 reduce the window's
gradient once, in it; the eager update mode starts updating during it), so "this one ends the window" is a
property of the backward, not of step(): by default the `grad_accum_steps`-th backward of the window, or an
earlier one the caller marks with `engine.backward(loss, end_window=True)`: an epoch's last, shorter window,
as Hugging Face's Trainer runs it (it scales that window's losses by its own length; the engine's
1/grad_accum_steps scaling is unchanged, so a plain loop that ends a window early scales its losses itself).
`step()` acts once after a window closed and is a no-op otherwise; a checkpoint is taken between windows.

Note [token-weighted windows]: with micro-batches of unequal label-token counts (padding, masked prompts), the
mean of per-micro-batch means is not the mean over the window's tokens: accumulation would change the loss
(the 2024 gradient-accumulation bug). As transformers' `num_items_in_batch`, a caller that knows the window's
items N (label tokens != -100 after the shift, over every micro-batch of the window on every rank) passes
`engine.backward(loss, num_items_in_batch=N)` with `loss` = this micro-batch's summed loss / N. The engine
then scales by the world size instead of 1/grad_accum_steps (the reducer averages over ranks): the window's
gradient is exactly that of one big batch's mean loss over its N items. A window is weighted in all its
backward passes or in none. The job counts N from its global batches (no collective: Note [same batches at
every world size]); the HF trainers get it from the Trainer, which counts it the same way.
"""

from __future__ import annotations


class AccumulationWindow:
    """The current window's backward passes taken, and whether a closed window awaits its step()."""

    def __init__(self, length: int):
        self.length = length
        self.steps = 0  # windows step() closed, their update applied or skipped: the caller's step count
        self.taken_in_window = 0  # backward passes of the open window so far
        self.closed = False  # the last backward ended a window and step() has not applied it yet
        self._end_now = False
        self._weighted = False  # the open window's backward passes carry num_items_in_batch

    def begin(self, end_window: bool, weighted: bool = False) -> None:
        """A backward starts; `end_window`: it ends the window whatever the count; `weighted`: its loss is a share
        of the window's items (Note [token-weighted windows])."""
        if self.taken_in_window and weighted != self._weighted:
            raise ValueError(f"engine.backward: num_items_in_batch {'given' if weighted else 'left out'} inside a "
                             f"window whose first backward {'left it out' if weighted else 'gave it'}: weight every "
                             f"micro-batch of a window by its items, or none (Note [token-weighted windows])")
        self._weighted = weighted
        self._end_now = end_window or self.taken_in_window + 1 >= self.length

    def share(self, world_size: int) -> float:
        """The factor of this backward's loss: 1 / length, or for a weighted window the world size (the reducer
        averages over the ranks, and a weighted window's shares are summed over them)."""
        return world_size if self._weighted else 1 / self.length

    def ends_now(self) -> bool:
        """Whether the backward running (or about to run) ends the window."""
        return self._end_now or self.taken_in_window + 1 >= self.length

    def taken(self) -> None:
        """The backward finished: count it, and close the window if it ended it."""
        if self._end_now:
            self.taken_in_window, self.closed = 0, True
        else:
            self.taken_in_window += 1
        self._end_now = False

    def stepped(self) -> None:
        self.closed = False
        self.steps += 1

    @property
    def between_windows(self) -> bool:
        return self.taken_in_window == 0
