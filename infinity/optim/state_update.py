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
updates accumulate in expectation. The random bits are a function of (train.seed, unit index, the
element's index in the unit's flat buffer, Adam step), never of a generator's state: the rounding of an
element does not depend on the world size, the stage, the sub-group size or where the update runs (CPU or
GPU), a resumed run rounds exactly as the uninterrupted one, and a reference can recompute it
(`rounding_bits`, `stochastic_round`). The bits: the low 16 bits of the fp32 pattern get 16 random bits
added, then are cut off (a carry rounds the magnitude up; infinities stay what they are, NaNs are cast as
they are).

Where the random bits come from: a table holding each 16-bit value once, in a fixed shuffled order; element i
takes the table's entry (i + r) mod 65536, xor k, where r is a hash of (seed, unit, step) and k a hash of
those and i // 65536 (its block). Over the steps each element's bits are uniform (k is) and independent (r
and k are new hashes each step); elements of different blocks are independent of each other (their own k);
two elements of one block get different table entries at distances that r moves every step, and a block's
65536 elements take every 16-bit value exactly once per step (stratified: the block's rounding errors sum
closer to zero than independent draws would). Its cost is one xor pass per element and a table slice per
block; a counter-based hash per element (2026-11-28, at fb4effa) was ~14 integer passes per pair of
elements, the most of the update's time. Runs resumed across that change round differently from
uninterrupted ones (within one version a resume is still bitwise).

Note [chunked upcast]: the 16-bit modes upcast, step and round back `_CHUNK` (2^18) elements at a time
through fp32 scratch buffers of one chunk, not the whole run at once: the upcast values stay in cache
between the conversion, the fused kernel and the rounding, and no run-sized fp32 copies are allocated
(and page-faulted) per update. A 12.6M-element block steps in ~15 ms with bf16 moments this way, against
~43 ms upcasting it whole (fp32 state: ~8 ms), on this project's 2-core machine. With a bf16 master the
rounding was most of the time: `bench_cpu_adam.py --only state_dtype`, 100M elements, 0.121 G elements/s on
2026-11-28 (a hash per element), 0.190 with a hash per two elements (fb4effa), 0.51-0.56 with the table
above and the scratch buffers reused across chunks (2026-11-29; fp32 1.50-1.61 in the same runs): about 3x the
fp32 kernel's time, what the cost model prices (traffic.CPU_UPDATE_COST). Each fresh tensor of a chunk was
page-faulted anew, so the update allocates nothing per chunk.

With bf16 compute a bf16 master is the parameters themselves on NVMe (the cast is the identity: Note
[aliased parameters]), 6 bytes per parameter in all; with fp32 compute the fp32 parameters are stored beside
it. Kahan-compensated bf16 masters (8 bytes) are not offered: stochastic rounding reaches 6.
"""

from __future__ import annotations

import functools

import torch

from infinity.memory.tier import StateDtype
from infinity.optim.cpu_adam import AdamHyper, adam_step

__all__ = ["Bf16Master", "Bf16Moments", "Fp32State", "StateUpdate", "rounding_bits", "state_update_for",
           "stochastic_round"]

_M32 = 0xFFFFFFFF
_MUL = 0x45D9F3B  # odd, < 2^31: a product with a 32-bit value fits in int64
_ROTATION = 0x2545F491  # (told apart from the blocks' keys: their hashes are of small block numbers)


def _mix(x):
    """A 32-bit integer hash (xor-shift, multiply), on Python ints or int64 tensors of values in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = (x * _MUL) & _M32
    x = x ^ (x >> 16)
    x = (x * _MUL) & _M32
    return x ^ (x >> 16)


def _round_into(out: torch.Tensor, x: torch.Tensor, bits: torch.Tensor) -> None:
    """`out` (bf16) = `stochastic_round(x, bits)`, the fp32 `x` contiguous; `bits` (int32) is overwritten."""
    pattern = bits.add_(x.view(torch.int32)).bitwise_and_(-65536).view(torch.float32)  # exact in bf16
    if x.device.type != "cpu" or torch.isnan(x.sum()):  # (a NaN makes the sum NaN; so may +inf with -inf)
        pattern = torch.where(torch.isnan(x), x, pattern)
    out.copy_(pattern)


_BLOCK = 1 << 16
"""Elements of a unit's flat buffer that share one rotation of the table and one 16-bit key per step."""


@functools.lru_cache(maxsize=None)
def _table(device: torch.device) -> torch.Tensor:
    """The 65536 16-bit values in a fixed shuffled order (sorted by their `_mix` hash), twice in a row (int32 on
    `device`): any rotation of the table is one contiguous slice. Made on the CPU: the same order everywhere."""
    order = torch.argsort(_mix(torch.arange(_BLOCK, dtype=torch.int64))).to(torch.int32)
    return torch.cat([order, order]).to(device)


def _rounding_bits_into(out: torch.Tensor, *, seed: int, unit: int, step: int, first: int) -> torch.Tensor:
    """`rounding_bits` for `out.numel()` elements, written into `out` (int32); returns it."""
    key = _mix(_mix(_mix(seed & _M32) ^ (unit & _M32)) ^ (step & _M32))
    rotation = _mix(key ^ _ROTATION) & 0xFFFF
    table = _table(out.device)
    end, i = first + out.numel(), first
    while i < end:
        block = i // _BLOCK
        stop = min(end, (block + 1) * _BLOCK)
        start = (i + rotation) % _BLOCK
        block_key = _mix(key ^ _mix(block & _M32)) & 0xFFFF
        torch.bitwise_xor(table[start:start + stop - i], block_key, out=out[i - first:stop - first])
        i = stop
    return out


def rounding_bits(numel: int, *, seed: int, unit: int, step: int, first: int, device: torch.device) -> torch.Tensor:
    """16 random bits (int32 in [0, 65536)) for the elements [first, first + numel) of unit `unit`'s flat buffer
    at Adam step `step`: a function of those numbers only (Note [16-bit optimizer state]). Element i's bits are
    the table's entry (i + r) mod 65536 xor k: r a hash of (seed, unit, step), k of those and i // 65536."""
    out = torch.empty(numel, dtype=torch.int32, device=device)
    return _rounding_bits_into(out, seed=seed, unit=unit, step=step, first=first)


def stochastic_round(x: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """fp32 `x` rounded to bf16 with the random `bits` (`rounding_bits`): up with probability equal to the
    fraction of the bf16 ulp that `x` is above the value below it, so E[result] = x. An infinity's pattern keeps
    its value through the add and the cut; a NaN's may carry into its exponent, so NaNs are cast as they are: on
    the CPU only when there are any (checked once, by the sum: the common case costs one more pass, not a select
    over every element); on a GPU always, as the select costs little there and the check would wait for the
    device."""
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=torch.bfloat16, device=x.device)
    _round_into(out, x, bits.clone())
    return out


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
        bits32 = torch.empty(p32.numel(), dtype=torch.int32, device=master.device)
        for a, b in _chunks(master.numel()):
            p, m, v = p32[:b - a], m32[:b - a], v32[:b - a]
            p.copy_(master[a:b])
            m.copy_(exp_avg[a:b])
            v.copy_(exp_avg_sq[a:b])
            adam_step(p, grad[a:b], m, v, step=step, hyper=hyper, grad_scale=grad_scale)
            exp_avg[a:b].copy_(m)
            exp_avg_sq[a:b].copy_(v)
            bits = _rounding_bits_into(bits32[:b - a], seed=self.seed, unit=unit, step=step, first=first + a)
            _round_into(master[a:b], p, bits)


def state_update_for(state_dtype: StateDtype, seed: int) -> StateUpdate:
    """The one place that picks the update's type from `[optimizer] state_dtype` (as the plan carries it)."""
    if state_dtype is StateDtype.BF16_MASTER:
        return Bf16Master(seed)
    return Bf16Moments() if state_dtype is StateDtype.BF16 else Fp32State()
