"""How one Adam update reads and writes the stored optimizer state: one type per `[optimizer] state_dtype`.

Note [16-bit optimizer state]: the optimizer state is the master weights and the two Adam moments,
12 bytes per trainable parameter in fp32; on NVMe and in host memory they are most of the bytes a step
moves and stores. `state_dtype` stores less of it; the update itself is always the fp32 Adam of
cpu_adam.py (the same fused kernel), only what is stored between updates changes:

    fp32         master fp32, moments fp32                                    12 bytes per element
    bf16         master fp32, moments bf16: upcast to fp32, the fp32 update,  8
                 the new moments rounded to nearest (even) back to bf16
    bf16_master  master bf16 too: upcast, the fp32 update, the moments         6
                 rounded to nearest, the new master rounded stochastically

So "bf16" is exactly torch.optim.AdamW in fp32 whose moments are rounded to bf16 after every step (the
reference the tests hold it to, bit for bit on the CPU). Rounding the moments costs little: Adam uses
them through m / sqrt(v), and bf16 keeps 8 significant bits of each, a relative error of 2^-9 on
quantities that are themselves noisy estimates.

The master is different: an update (lr x m / sqrt(v), about lr) is far below one bf16 ulp of a weight
(2^-8 of it), so a master rounded to nearest would mostly not move at all. Stochastic rounding rounds up
with probability (x - down) / (up - down), so the stored weight is unbiased: E[round(x)] = x, and small
updates accumulate in expectation. The random bits come from a counter-based hash of (train.seed, unit
index, the element's index in the unit's flat buffer, Adam step), never from a generator's state: the
rounding of an element does not depend on the world size, the stage, the sub-group size or where the
update runs (CPU or GPU), a resumed run rounds exactly as the uninterrupted one, and a reference can
recompute it (`stochastic_round`). The bits: the low 16 bits of the fp32 pattern get 16 random bits
added, then are cut off (a carry rounds the magnitude up; infinities stay what they are, NaNs are cast as
they are). Each 32-bit hash serves two elements (2k its low half, 2k + 1 its high half): half the
hashing, still a function of the element's index alone.

Note [chunked upcast]: the 16-bit modes upcast, step and round back `_CHUNK` (2^18) elements at a time
through fp32 scratch buffers of one chunk, not the whole run at once: the upcast values stay in cache
between the conversion, the fused kernel and the rounding, and no run-sized fp32 copies are allocated
(and page-faulted) per update. A 12.6M-element block steps in ~15 ms with bf16 moments this way, against
~43 ms upcasting it whole (fp32 state: ~8 ms), on this project's 2-core machine; with a bf16 master, whose
rounding bits are a hash per element, ~76 ms against ~570 ms. The rounding was most of that: on 2026-11-28
(`bench_cpu_adam.py --only state_dtype`, 100M elements) a hash per two elements and no select over the
finite values (NaNs checked once) took the bf16 master's update from 0.121 to 0.190 G elements/s (fp32:
1.70), what the cost model prices (traffic.CPU_UPDATE_COST).

With bf16 compute a bf16 master is the parameters themselves on NVMe (the cast is the identity: Note
[aliased parameters]), 6 bytes per parameter in all; with fp32 compute the fp32 parameters are stored beside
it. Kahan-compensated bf16 masters (8 bytes) are not offered: stochastic rounding reaches 6.
"""

from __future__ import annotations

import torch

from infinity.memory.tier import StateDtype
from infinity.optim.cpu_adam import AdamHyper, adam_step

__all__ = ["Bf16Master", "Bf16Moments", "Fp32State", "StateUpdate", "rounding_bits", "state_update_for",
           "stochastic_round"]

_M32 = 0xFFFFFFFF
_MUL = 0x45D9F3B  # odd, < 2^31: a product with a 32-bit value fits in int64


def _mix(x):
    """A 32-bit integer hash (xor-shift, multiply), on Python ints or int64 tensors of values in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = (x * _MUL) & _M32
    x = x ^ (x >> 16)
    x = (x * _MUL) & _M32
    return x ^ (x >> 16)


def rounding_bits(numel: int, *, seed: int, unit: int, step: int, first: int, device: torch.device) -> torch.Tensor:
    """16 random bits (int32 in [0, 65536)) for the elements [first, first + numel) of unit `unit`'s flat buffer
    at Adam step `step`: a function of those numbers only (Note [16-bit optimizer state]); one 32-bit hash of the
    pair index k serves elements 2k (its low 16 bits) and 2k + 1 (its high 16 bits)."""
    key = _mix(_mix(_mix(seed & _M32) ^ (unit & _M32)) ^ (step & _M32))
    pairs = first // 2
    x = torch.arange(pairs, (first + numel + 1) // 2, dtype=torch.int64, device=device)
    x.bitwise_and_(_M32).bitwise_xor_(key)
    shifted = torch.empty_like(x)
    for round_ in range(3):  # _mix, in place (the same values, without a new tensor per operation)
        x.bitwise_xor_(torch.bitwise_right_shift(x, 16, out=shifted))
        if round_ < 2:
            x.mul_(_MUL).bitwise_and_(_M32)
    low = torch.empty(x.numel(), dtype=torch.int32, device=device)  # (each value's low 32-bit word,
    low.copy_(x.view(torch.int32)[::2])                              # little-endian: no conversion)
    halves = low.view(torch.int16)  # (its low 16 bits, then its high 16 bits)
    start = first - 2 * pairs
    return halves[start:start + numel].to(torch.int32).bitwise_and_(0xFFFF)


def stochastic_round(x: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """fp32 `x` rounded to bf16 with the random `bits` (`rounding_bits`): up with probability equal to the
    fraction of the bf16 ulp that `x` is above the value below it, so E[result] = x. An infinity's pattern keeps
    its value through the add and the cut; a NaN's may carry into its exponent, so NaNs are cast as they are: on
    the CPU only when there are any (checked once: the common case costs one more pass, not a select over every
    element); on a GPU always, as the select costs little there and the check would wait for the device."""
    pattern = x.contiguous().view(torch.int32)
    rounded = (pattern + bits).bitwise_and_(-65536).view(torch.float32).to(torch.bfloat16)  # exact: low bits zero
    nan = torch.isnan(x)
    if x.device.type != "cpu" or bool(nan.any()):
        rounded = torch.where(nan, x.to(torch.bfloat16), rounded)
    return rounded


_CHUNK = 1 << 18
"""Elements upcast and stepped at a time by the 16-bit modes (Note [chunked upcast]): a multiple of 64, so the
fused kernel's results are those of one call over the whole run (Note [sub-groups] in cpu_adam.py)."""


def _chunks(numel: int):
    """(start, end) of each `_CHUNK`-element piece of a run of `numel` elements."""
    return ((a, min(a + _CHUNK, numel)) for a in range(0, numel, _CHUNK))


def _scratch(numel: int, count: int, device: torch.device) -> list[torch.Tensor]:
    """`count` fp32 buffers of one chunk each, for the upcast values (fresh per run: a few hundred KiB)."""
    return [torch.empty(min(numel, _CHUNK), dtype=torch.float32, device=device) for _ in range(count)]


class StateUpdate:
    """One Adam update of a run of elements, given the stored master, moments and the fp32 gradient (views
    into the fetched buffers, in the plan's dtypes); leaves the new values in those buffers."""

    bytes_per_element = 16  # master + moments + gradient read and written per element stepped (profile spans)

    def step(self, master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
             step: int, hyper: AdamHyper, grad_scale: float | None, unit: int, first: int) -> None:
        """`unit`, `first`: the unit's index and the flat-buffer index of the run's first element."""
        raise NotImplementedError


class Fp32State(StateUpdate):
    """fp32 state: the fused kernel on the stored buffers themselves."""

    def step(self, master, grad, exp_avg, exp_avg_sq, *, step, hyper, grad_scale, unit, first):
        adam_step(master, grad, exp_avg, exp_avg_sq, step=step, hyper=hyper, grad_scale=grad_scale)


class Bf16Moments(StateUpdate):
    """bf16 moments: upcast, the fp32 update, rounded to nearest back into the stored moments."""

    bytes_per_element = 12

    def step(self, master, grad, exp_avg, exp_avg_sq, *, step, hyper, grad_scale, unit, first):
        m32, v32 = _scratch(master.numel(), 2, master.device)
        for a, b in _chunks(master.numel()):
            m, v = m32[:b - a], v32[:b - a]
            m.copy_(exp_avg[a:b])
            v.copy_(exp_avg_sq[a:b])
            adam_step(master[a:b], grad[a:b], m, v, step=step, hyper=hyper, grad_scale=grad_scale)
            exp_avg[a:b].copy_(m)  # round to nearest even
            exp_avg_sq[a:b].copy_(v)


class Bf16Master(StateUpdate):
    """bf16 master and moments: upcast, the fp32 update, moments rounded to nearest, the master stochastically."""

    bytes_per_element = 10

    def __init__(self, seed: int):
        self.seed = seed

    def step(self, master, grad, exp_avg, exp_avg_sq, *, step, hyper, grad_scale, unit, first):
        p32, m32, v32 = _scratch(master.numel(), 3, master.device)
        for a, b in _chunks(master.numel()):
            p, m, v = p32[:b - a], m32[:b - a], v32[:b - a]
            p.copy_(master[a:b])
            m.copy_(exp_avg[a:b])
            v.copy_(exp_avg_sq[a:b])
            adam_step(p, grad[a:b], m, v, step=step, hyper=hyper, grad_scale=grad_scale)
            exp_avg[a:b].copy_(m)
            exp_avg_sq[a:b].copy_(v)
            bits = rounding_bits(b - a, seed=self.seed, unit=unit, step=step, first=first + a, device=p.device)
            master[a:b].copy_(stochastic_round(p, bits))


def state_update_for(state_dtype: StateDtype, seed: int) -> StateUpdate:
    """The one place that picks the update's type from `[optimizer] state_dtype` (as the plan carries it)."""
    if state_dtype is StateDtype.BF16_MASTER:
        return Bf16Master(seed)
    return Bf16Moments() if state_dtype is StateDtype.BF16 else Fp32State()
