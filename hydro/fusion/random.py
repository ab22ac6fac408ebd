"""Per-trial random streams of a fused model: counter-based, computed for all trials at once.

A trial's dropout masks must be the ones it would draw trained alone, whatever its slot, its
group or the trials beside it, and a fused step must launch the same ATen ops for any number of
trials. A stateful generator gives neither: torch's one stream serves the whole folded batch, so
a trial's mask depends on where its rows sit. Here every random number is a pure function

    bits = hash(trial seed, trial step, salt, element index)

computed with vectorized integer tensor ops: the *seed* of each trial (``trial_seed``, a
per-trial ``int64`` buffer of the fused model), its *step* (``trial_step``, the training
forwards that trial has run), the *salt* (the random op's rank among the graph's random ops, a
property of the architecture) and the element's flat index in that trial's own tensor (its
layout in the fused batch plays no part).

The mixer is Chris Wellons' ``lowbias32`` (xor-shift, multiply, twice; published constants).
The seed and the step are folded in 32 bits at a time into two per-trial keys per op
(:func:`stream_keys`, a few tiny ``int64`` ops per forward).

Two element draws, two versions:

- ``rand_like``/``randn_like``/``bernoulli`` (:func:`uniform_bits`): ``mix(mix(index ^ key_a) ^
  key_b)`` on 32-bit values held in ``int64`` (each multiplier as its signed 32-bit equivalent,
  so no overflow is relied on; ``& 0xFFFFFFFF`` is the product modulo ``2**32``), of which the
  top 24 bits are the uniform.
- dropout (:func:`dropout`, draw version :data:`DRAW_VERSION` 2): the cost of a training step
  with dropout at every site, so it is cut to the bone. One 32-bit hash serves two elements:
  pair ``j`` (elements ``2j`` and ``2j + 1`` of the trial's tensor) hashes to
  ``mix(c[j] ^ key_a)`` in ``int32`` (wraparound multiplies, shifts masked to act as logical
  ones), where ``c[j] = mix(j)`` depends on the index alone and is computed once per size and
  device (then cached). Its low 16 bits decide element ``2j``, its high 16 bits element
  ``2j + 1`` (read as ``int16`` halves of the little-endian word: every machine torch runs
  on). A half ``s`` stands for the 16-bit uniform ``u = s + 2**15`` (the half with its top bit
  flipped: a bijection, so ``u`` is as uniform as the hash), and an element is kept when
  ``u >= ceil(p * 2**16)``, one ``int16`` compare. **The rate is quantized up to a multiple
  of 2**-16** (0.1 drops 6554 / 65536 = 0.1000061 of the elements; a rate below 1 drops at
  most 65535 / 65536); the version-1 draw had 24 bits.
  About 12 ``int32`` ops per pair against 20 ``int64`` ops per element before: the draw is a
  fifth of the dropout's cost, the rest is the mask and the multiply, as in torch's own.

The draw version travels with each trial (the fused model's ``trial_draw`` buffer, in every
``state_dict`` and trial checkpoint): a checkpoint of version 1 (the 24-bit ``int64`` dropout
draw, hydro before this draw) cannot go on bit-identically, and a model that draws refuses it
(:class:`~hydro.errors.FuseError`, see :meth:`hydro.fusion.FusedModel.load_trial_state`).
"""

from __future__ import annotations

import functools
import math
import weakref

import torch

from hydro.errors import FuseError

SEED = "trial_seed"  # buffer: each trial's stream seed, int64 [n]
STEP = "trial_step"  # buffer: training forwards each trial has run, int64 [n]
DRAW = "trial_draw"  # buffer: the dropout draw each trial's stream was made with, int64 [n]
DRAW_VERSION = 2  # 1: 24 bits per element from int64 ops (a checkpoint without DRAW); 2: below

_M32 = 0xFFFFFFFF
_BITS = 24  # resolution of the uniforms: 2**-24
_DROP_BITS = 16  # resolution of a dropout rate: 2**-16 (two draws per 32-bit hash)


def _signed(c: int) -> int:
    """A 32-bit constant as the signed value congruent to it modulo ``2**32``."""
    return c - (1 << 32) if c >= 1 << 31 else c


_MUL1, _MUL2 = _signed(0x7FEB352D), _signed(0x846CA68B)  # lowbias32
_SEED_SALT, _KEY_A, _KEY_B = 0x9E3779B9, 0x85EBCA6B, 0xC2B2AE35


def as_int64(seed: int) -> int:
    """Any Python integer as the ``int64`` with the same low 64 bits (a seed of any size)."""
    seed = int(seed) & ((1 << 64) - 1)
    return seed - (1 << 64) if seed >= 1 << 63 else seed


def _mix_(x: torch.Tensor) -> torch.Tensor:
    """``lowbias32`` in place on ``int64`` values in ``[0, 2**32)``."""
    x ^= x >> 16
    x.mul_(_MUL1).bitwise_and_(_M32)
    x ^= x >> 15
    x.mul_(_MUL2).bitwise_and_(_M32)
    x ^= x >> 16
    return x


def mix32(x: torch.Tensor) -> torch.Tensor:
    """The 32-bit hash of ``int64`` values in ``[0, 2**32)`` (a new tensor).

    Example:
        >>> import torch
        >>> mix32(torch.tensor([0, 1, 2**32 - 1])).tolist()
        [0, 1753845952, 1734902346]
    """
    return _mix_(x.to(torch.int64).clone())


def stream_keys(seed: torch.Tensor, step: torch.Tensor, count: int) -> torch.Tensor:
    """Every random op's two keys for every trial at this step: ``int64 [count, 2, n]``.

    Args:
        seed: each trial's seed, ``int64 [n]`` (any value).
        step: each trial's step counter, ``int64 [n]`` (non-negative).
        count: the number of random ops (salts ``0 .. count - 1``).
    """
    h = _mix_((seed & _M32) ^ _SEED_SALT)
    h = _mix_(h ^ ((seed >> 32) & _M32))
    h = _mix_(h ^ (step & _M32))
    h = _mix_(h ^ ((step >> 32) & _M32))
    salt = torch.arange(count, dtype=torch.int64, device=seed.device).unsqueeze(1)
    h = _mix_(h.unsqueeze(0) ^ salt)  # [count, n]
    return torch.stack([_mix_(h ^ _KEY_A), _mix_(h ^ _KEY_B)], dim=1)


def uniform_bits(keys: torch.Tensor, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
    """Each trial's random integers in ``[0, 2**24)`` for a tensor of one trial's ``shape``.

    Args:
        keys: one op's keys, ``int64 [2, n]`` (a row of :func:`stream_keys`).
        shape: one trial's tensor shape.

    Returns:
        ``int64 [n, *shape]``; element ``i`` of trial ``k`` depends on trial ``k``'s keys and on
        ``i`` (its flat index in ``shape``) only.
    """
    return _hash(keys, shape) >> (32 - _BITS)


def _hash(keys: torch.Tensor, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
    """The 32 random bits of every element (the uniform is the top 24)."""
    numel = math.prod(shape)
    if numel >= 1 << 32:  # the hash takes 32-bit inputs
        raise FuseError(
            f"a random op draws {numel} numbers per trial; Hydro's per-trial streams index "
            "at most 2**32 elements per op and trial. Use smaller batches or tensors"
        )
    n, ones = keys.shape[1], [1] * len(shape)
    index = torch.arange(numel, dtype=torch.int64, device=keys.device)
    h = _mix_(index.view(1, *shape) ^ keys[0].view(n, *ones))
    h ^= keys[1].view(n, *ones)
    return _mix_(h)


def _mix32_(h: torch.Tensor) -> torch.Tensor:
    """``lowbias32`` in place on ``int32`` values (bit patterns; multiplies wrap modulo
    ``2**32``). torch's ``>>`` on ``int32`` is arithmetic: the mask makes it logical."""
    h ^= (h >> 16) & 0xFFFF
    h.mul_(_MUL1)
    h ^= (h >> 15) & 0x1FFFF
    h.mul_(_MUL2)
    h ^= (h >> 16) & 0xFFFF
    return h


def _counters(pairs: int, device: torch.device) -> torch.Tensor:
    """``mix(j)`` for ``j < pairs`` (``int32 [pairs]``): the index half of every dropout hash,
    a constant per size and device, so eager steps read it instead of making it (it is shared
    by the trials: with ``n`` of them, ``1 / (n + 1)`` of the hashing). Under tracing
    (torch.compile, ``make_fx``) or any dispatch mode it is made inline: a traced tensor must
    not be cached, and inductor fuses it into the one kernel."""
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack():
        return _mix32_(torch.arange(pairs, dtype=torch.int32, device=device))
    return _cached_counters(pairs, torch.device(device))


@functools.lru_cache(maxsize=32)  # a few activation sizes per model (and a last short batch)
def _cached_counters(pairs: int, device: torch.device) -> torch.Tensor:
    with torch.inference_mode(False), torch.no_grad():  # a plain tensor, usable anywhere
        return _mix32_(torch.arange(pairs, dtype=torch.int32, device=device))


def _as_int32(v: torch.Tensor) -> torch.Tensor:
    """``int64`` values in ``[0, 2**32)`` as the ``int32`` with the same bits."""
    return (((v + (1 << 31)) & _M32) - (1 << 31)).to(torch.int32)


def drop_bits(keys: torch.Tensor, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
    """Each trial's dropout draws for a tensor of one trial's ``shape``: ``int16 [n, *shape]``,
    each the signed half ``s = u - 2**15`` of a uniform 16-bit ``u`` (draw version 2, see the
    module's notes).

    Args:
        keys: one op's keys, ``int64 [2, n]`` (a row of :func:`stream_keys`); the first is used.
        shape: one trial's tensor shape.

    Returns:
        element ``i`` of trial ``k`` depends on trial ``k``'s keys and on ``i`` only (a view:
        it may not be contiguous when the size is odd).
    """
    numel = math.prod(shape)
    if numel >= 1 << 32:  # the counters are int32 pair indices
        raise FuseError(
            f"a dropout draws {numel} numbers per trial; Hydro's per-trial streams index "
            "at most 2**32 elements per op and trial. Use smaller batches or tensors"
        )
    n, pairs = keys.shape[1], (numel + 1) // 2
    h = _counters(pairs, keys.device) ^ _as_int32(keys[0]).view(n, 1)  # [n, pairs], new
    half = _mix32_(h).view(torch.int16)  # [n, 2 * pairs]: element 2j is pair j's low half
    if 2 * pairs != numel:
        half = half[:, :numel]
    return half.view(n, *shape) if half.is_contiguous() else half.reshape(n, *shape)


def _threshold(p: float) -> int:
    """The ``int16`` an element's draw must reach to be kept at rate ``p`` (``p`` quantized up
    to a multiple of ``2**-16``; a rate of 1 is no threshold but a scale of 0)."""
    return min(math.ceil(p * (1 << _DROP_BITS)), (1 << _DROP_BITS) - 1) - (1 << 15)


def dropout(t: torch.Tensor, p: float | torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Dropout of ``t`` (``[n, *one trial's shape]``) with each trial's rate and stream.

    An element is kept with probability ``1 - ceil(p * 2**16) / 2**16`` (``p`` to 16 bits, see
    the module's notes) and scaled by ``1 / (1 - p)`` computed in ``t``'s dtype, as torch
    scales; ``p = 0`` keeps every element (an exact identity), ``p = 1`` drops them all.

    One mask in ``t``'s dtype (``0`` or the scale) is made once and is what autograd keeps for
    the backward (a multiply), as before this draw: recomputing it there would cost a second
    draw, and a boolean mask a second pass.

    Args:
        t: the values, trial dimension first.
        p: one rate for all trials, or ``[n]`` (float64) each trial's own.
        keys: this op's keys, ``int64 [2, n]``.
    """
    n, rank = t.shape[0], t.dim() - 1
    bits = drop_bits(keys, t.shape[1:])
    # the mask as keep.to(dtype) * scale: two passes, yet half the time of one torch.where on
    # the CPU (0.62 against 1.2 ns per element); exact, as 1 * scale is scale
    if not isinstance(p, torch.Tensor):  # plain numbers: no tensor made on the device
        keep = bits >= _threshold(float(p))
        return t * keep.to(t.dtype).mul_(_keep_scale(float(p), t.dtype))
    threshold, scale = _rates(p, n, rank, t.dtype)
    return t * (bits >= threshold).to(t.dtype).mul_(scale)


# per-trial rates -> (key, threshold, scale): a fused graph reads its rates from one constant
# tensor at every step, and the dozen tiny ops that turn them into a threshold and a scale
# cost as much as a tenth of the dropout's time at every site (dispatch, not arithmetic)
# (keyed by identity, checked through a weak reference: tensors compare elementwise, so they
# cannot be the keys of a WeakKeyDictionary)
_RATES: dict[int, tuple] = {}


def _rates(
    p: torch.Tensor, n: int, rank: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-trial rates ``p [n]`` as the ``int16`` threshold their draws must reach and the
    scale ``1 / (1 - p)`` in ``dtype``, both ``[n, 1, ...]`` (``rank`` ones), kept per rate
    tensor while it is unchanged (its version), except under tracing."""
    traced = torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack()
    key = (p._version, n, rank, dtype, p.device)
    if not traced:
        hit = _RATES.get(id(p))
        if hit is not None and hit[0]() is p and hit[1] == key:
            return hit[2], hit[3]
    q64 = p.to(torch.float64).view(n, *[1] * rank)
    units = torch.ceil(q64 * (1 << _DROP_BITS)).clamp_(0, (1 << _DROP_BITS) - 1)
    threshold = (units - (1 << 15)).to(torch.int16)
    q = (1.0 - q64).to(dtype)
    scale = torch.where(q > 0, 1.0 / q.clamp_min(torch.finfo(dtype).tiny), 0.0)
    if not traced and not p.requires_grad:
        if len(_RATES) >= 256:  # rates of graphs long gone (ids of dead tensors)
            _RATES.clear()
        _RATES[id(p)] = (weakref.ref(p), key, threshold, scale)
    return threshold, scale


# marked a constant of the graph for torch.compile (no graph break) by hydro.fusion.compiled when
# it first compiles: the decorator imports torch._dynamo, 1.3 s that eager runs need not pay
def _keep_scale(p: float, dtype: torch.dtype) -> float:
    """``1 / (1 - p)`` as torch's dropout scales, in ``dtype`` (0 for ``p = 1``)."""
    return _keep_scale_cached(p, dtype)


@functools.lru_cache(maxsize=256)
def _keep_scale_cached(p: float, dtype: torch.dtype) -> float:
    # computed once per rate, since it reads a (host) value
    q = torch.tensor(1.0 - p, dtype=torch.float64).to(dtype)
    return float(1.0 / q) if q > 0 else 0.0


def uniform(keys: torch.Tensor, shape: torch.Size | tuple[int, ...], dtype: torch.dtype):
    """``rand_like`` per trial: ``[n, *shape]`` uniform on ``[0, 1)`` in steps of ``2**-24``."""
    return uniform_bits(keys, shape).to(dtype) * 2.0**-_BITS


def normal(keys: torch.Tensor, shape: torch.Size | tuple[int, ...], dtype: torch.dtype):
    """``randn_like`` per trial: ``[n, *shape]`` standard normal by Box-Muller from two uniforms
    (the second from keys mixed once more); with 24-bit uniforms the tails end at 5.77."""
    other = _mix_((keys ^ _SEED_SALT) & _M32)
    u1 = (uniform_bits(keys, shape).to(torch.float64) + 1.0) * 2.0**-_BITS  # (0, 1]: log is finite
    u2 = uniform_bits(other, shape).to(torch.float64) * (2.0 * math.pi * 2.0**-_BITS)
    return (torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(u2)).to(dtype)


def bernoulli(
    keys: torch.Tensor, shape: torch.Size | tuple[int, ...], p: object, dtype: torch.dtype
) -> torch.Tensor:
    """``bernoulli`` per trial: ``[n, *shape]`` of 1 with probability ``p`` (to 24 bits), else 0;
    ``p`` a float, ``[n]`` per trial, or ``[n, *shape]`` per element."""
    n = keys.shape[1]
    bits = uniform_bits(keys, shape)
    if not isinstance(p, torch.Tensor):
        return (bits < math.ceil(float(p) * (1 << _BITS))).to(dtype)
    p = p.to(torch.float64)
    if p.dim() == 1 and len(shape):
        p = p.view(n, *[1] * len(shape))
    return (bits < torch.ceil(p * (1 << _BITS))).to(dtype)
