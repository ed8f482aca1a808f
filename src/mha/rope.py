"""Rotary position embeddings (RoPE, Su et al. 2021): the position encoding of Llama, Qwen,
Mistral, Gemma, Phi, SmolLM2 and gpt-oss, applied to Q and K after the projections.

Shape legend: B batch, H heads (h or h_kv), T tokens, d head dim (d_k), r the rotated dims
(``dim <= d``, even), p positions (int, >= 0).

The formula. With frequencies ``w_i = theta^(-2i / r)`` for ``i < r/2`` (then scaled, below),
the angle of pair ``i`` at position ``p`` is ``a = p * w_i``, and each pair of Q's (and K's)
first ``r`` dims is turned by ``a``::

    (x1, x2) -> (x1 cos a - x2 sin a,  x2 cos a + x1 sin a)

The pairs are the two halves, ``(x[i], x[i + r/2])`` (GPT-NeoX, Llama, and transformers'
``rotate_half``: ``interleaved=False``), or neighbours, ``(x[2i], x[2i + 1])`` (GPT-J, the
paper: ``interleaved=True``). Dims ``r..d`` pass unchanged (partial rotary, GPT-NeoX / Phi).
A rotation by ``p_q w`` of the query and ``p_k w`` of the key leaves their dot product a
function of ``p_q - p_k`` alone, so shifting every position by one constant changes nothing:
only positions within one sequence matter, never where it sits in storage.

Scaling (``scaling=``, transformers' ``rope_parameters`` spelling, so a model's config entry
can be passed as it is):

- ``{"rope_type": "linear", "factor": f}``: ``w_i / f`` (position interpolation).
- ``{"rope_type": "llama3", "factor": f, "low_freq_factor": lo, "high_freq_factor": hi,
  "original_max_position_embeddings": L}`` (Llama 3.1): with the wavelength
  ``lam_i = 2 pi / w_i``, ``w_i`` is kept where ``lam_i < L / hi``, divided by ``f`` where
  ``lam_i > L / lo``, and in between ``(1 - s) w_i / f + s w_i`` with
  ``s = (L / lam_i - lo) / (hi - lo)``.

Precision: frequencies, angles, cos and sin are computed in float64 (positions are exact
there) and rounded to float32 once; the rotation itself runs in float32 (float64 for float64
inputs) and its result is rounded once to the input's dtype. The float32 cos / sin are cached
per device for positions ``0 .. n-1`` (``n`` grown in powers of two up to ``_TABLE_CAP``; calls
reaching past it compute their own angles, uncached; the tables are not pickled), spread to one
``cos`` and one signed ``sin`` per dim (``x * C + partner(x) * S``: a multiply, then a
multiply-add into each half of the pairs, or for a small call of halves one multiply-add
of the rolled halves); under ``torch.compile`` / ``torch.export`` they are
computed from the positions instead (the same float64 formula), so a traced program holds no
table and ``T`` may stay symbolic. Positions are ints in ``[0, MAX_POSITION]`` (``2**31 - 1``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from mha.checks import (
    check_bool,
    check_int,
    check_int_tensor,
    check_readable,
    check_scalar,
    check_tensor,
)

#: the keys of each scaling's dict, besides "rope_type"
SCALINGS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}
_MIN_TABLE = 256  # positions of the first cached table (grown by doubling)
#: the most rotated elements rotated by one ``roll`` of the halves (3 ops; a decode step's Q and
#: K): fp32, 128 KiB, glibc's default mmap threshold, below which the rolled copy comes from the
#: heap, already faulted in; larger calls add into each half instead (no copy)
_ROLL_MAX = 1 << 15
#: the largest cached table (a power of two): 2**15 positions of r float32 cos and sin each,
#: 32 MiB for r = 128; positions past it are computed per call
_TABLE_CAP = 1 << 15
#: the largest position accepted (checked outside torch.compile / torch.export): far beyond
#: any context length, with angles ``p * w`` exact in float64
MAX_POSITION = 2 ** 31 - 1


@dataclass(frozen=True)
class Rotary:
    """Rotary position embeddings over the first ``dim`` dims of each head (see the module
    docstring for the formula).

    Args:
        dim: r, the rotated dims: even, and at most the head dim it is applied to (the whole
            head for Llama; ``partial_rotary_factor * d`` for GPT-NeoX / Phi).
        theta: the base of the frequencies, a finite number > 0 (Llama 2: 10000, Llama 3:
            500000).
        interleaved: pairs of neighbours (GPT-J) instead of halves (NeoX / Llama / HF).
        scaling: None, or a dict in transformers' ``rope_parameters`` spelling with
            ``"rope_type"`` ``"linear"`` or ``"llama3"`` and that type's keys (other keys of a
            config entry, ``"rope_theta"`` and ``"partial_rotary_factor"``, are ignored: pass
            them as ``theta`` / ``dim``).

    Frozen and hashable (equal settings compare equal); it holds no parameters, so a module
    using it has nothing more in its state dict. Invalid settings raise, naming the argument.
    """

    dim: int
    theta: float = 10000.0
    interleaved: bool = False
    scaling: tuple | None = None  # normalised to ((key, value), ...) sorted, "rope_type" first
    _tables: dict = field(default_factory=dict, init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        dim = check_int("dim", self.dim, low=2, what="an even int >= 2")
        if dim % 2:
            raise ValueError(f"dim must be an even int >= 2 (dims are rotated in pairs), got {dim}")
        theta = check_scalar("theta", self.theta, low=0.0)
        if theta == 0.0:
            raise ValueError("theta must be a finite number > 0 (the base of the frequencies "
                             "theta^(-2i/dim)), got 0.0")
        object.__setattr__(self, "dim", dim)
        object.__setattr__(self, "theta", theta)
        object.__setattr__(self, "interleaved", check_bool("interleaved", self.interleaved))
        object.__setattr__(self, "scaling", _check_scaling(self.scaling))
        object.__setattr__(self, "_tables", {})
        w = self.inv_freq()  # (r/2,)
        if not bool(torch.isfinite(w).all()):  # e.g. a subnormal factor: w / f overflows
            name = "theta" if self.scaling is None else "scaling"
            raise ValueError(f"{name}: the frequencies theta^(-2i/dim) (scaled) overflow to "
                             f"inf with theta={theta}, scaling={dict(self.scaling or {})}; "
                             f"every angle would be NaN")

    def __getstate__(self) -> dict:
        """Pickled (``torch.save`` of a module, copies) without the cached tables."""
        return {**self.__dict__, "_tables": {}}

    def __repr__(self) -> str:
        scaling = "" if self.scaling is None else f", scaling={dict(self.scaling)}"
        inter = ", interleaved=True" if self.interleaved else ""
        return f"Rotary(dim={self.dim}, theta={self.theta}{inter}{scaling})"

    # ------------------------------------------------------------------ frequencies
    def inv_freq(self) -> torch.Tensor:
        """``(r/2,)`` float64 on the CPU: ``w_i = theta^(-2i/r)``, scaled."""
        i = torch.arange(0, self.dim, 2, dtype=torch.float64, device="cpu")  # (r/2,): 2i
        w = 1.0 / self.theta ** (i / self.dim)  # (r/2,)
        if self.scaling is None:
            return w
        s = dict(self.scaling)
        if s["rope_type"] == "linear":
            return w / s["factor"]
        f, lo, hi, L = (s[k] for k in SCALINGS["llama3"])
        lam = 2 * math.pi / w  # (r/2,) wavelengths
        smooth = (L / lam - lo) / (hi - lo)  # (r/2,)
        mid = (1 - smooth) * w / f + smooth * w
        return torch.where(lam < L / hi, w, torch.where(lam > L / lo, w / f, mid))

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype = torch.float32):
        """``(cos, sin)`` of the angles ``positions[..., None] * w``: ``(..., r/2)`` each, computed
        in float64 and returned in ``dtype``, on ``positions``' device (ints >= 0, unchecked)."""
        return _cos_sin(positions, self.inv_freq().to(positions.device), dtype)

    def _table(self, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The cached float32 ``(C, S)`` (:meth:`angles`) ``(N, r)`` for positions
        ``0 .. N-1``, ``N >= n`` (``n <= _TABLE_CAP``)."""
        table = self._tables.get(device)
        if table is None or table[0].shape[0] < n:
            N = max(_MIN_TABLE, 1 << (n - 1).bit_length())
            p = torch.arange(N, device=device)  # (N,)
            table = _spread(*self.cos_sin(p, torch.float32), self.interleaved)  # (N, r) each
            self._tables[device] = table
        return table

    # ------------------------------------------------------------------ the rotation
    def apply_rotary(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Rotate ``x (B, H, T, d)`` (``d >= dim``) at ``positions``: ``(T,)`` (every row) or
        ``(B, T)`` (one row each, e.g. transformers' ``position_ids`` of a left-padded batch;
        ``(1, T)`` broadcasts) ints >= 0; None = ``0 .. T-1`` (computed from T alone, so
        ``torch.export`` keeps T dynamic). Returns a new tensor of ``x``'s shape and dtype;
        refusals name the argument."""
        _check_x(x, self.dim, "(B, H, T, d)")
        C, S = self.angles(positions, x.shape[0], x.shape[2], x.device, x.dtype)  # (B|1, T, r)
        return _rotate(x, C[:, None], S[:, None], self.interleaved)  # (B|1, 1, T, r)

    def rotate_tokens(self, x: torch.Tensor, C: torch.Tensor, S: torch.Tensor) -> torch.Tensor:
        """The same rotation for ``x (B, T, H, d)`` (the projections' layout, heads not yet
        split) by ``(C, S)`` of :meth:`angles`, shared by Q and K: a new ``(B, T, H, d)``
        tensor of ``x``'s dtype."""
        _check_x(x, self.dim, "(B, T, H, d)")
        return _rotate(x, C[:, :, None], S[:, :, None], self.interleaved)  # (B|1, T, 1, r)

    def angles(self, positions, B: int, T: int, device: torch.device,
               dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """``(C, S)`` ``(B|1, T, r)`` for ``positions`` (checked: ``(T,)``, ``(B, T)`` or
        ``(1, T)`` ints >= 0; None = ``0 .. T-1``): each dim's ``cos`` and signed ``sin`` of
        its pair's angle, so that the rotation is ``x * C + partner(x) * S`` (``partner``
        swaps the two dims of each pair). float32 — float64 when ``dtype`` is float64 (the
        rotation's precision for inputs of ``dtype``). ``device``: a device or its name."""
        device = torch.device(device)  # "cpu" compares unequal to torch.device("cpu")
        work = torch.float64 if dtype == torch.float64 else torch.float32
        eager = work == torch.float32 and not torch.compiler.is_compiling()
        if positions is None and eager and T <= _TABLE_CAP:
            C, S = self._table(T, device)  # (N, r) each, N >= T
            return C[None, :T], S[None, :T]  # (1, T, r): positions 0 .. T-1
        positions = torch.arange(T, device=device) if positions is None \
            else check_positions(positions, B, T, device)  # (T,), (B, T) or (1, T)
        if positions.dim() == 1:
            positions = positions[None]  # (T,) -> (1, T)
        if eager:
            n = int(positions.max()) + 1 if positions.numel() else 1
            if n <= _TABLE_CAP:
                C, S = self._table(n, device)  # (N, r) each
                return C[positions], S[positions]  # (B|1, T, r)
        return _spread(*self.cos_sin(positions, work), self.interleaved)  # (B|1, T, r)


def _cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype):
    """``cos``, ``sin`` of ``positions[..., None] * inv_freq`` in float64, then ``dtype``."""
    angles = positions.to(torch.float64)[..., None] * inv_freq  # (..., 1) * (r/2,) -> (..., r/2)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _spread(cos: torch.Tensor, sin: torch.Tensor, interleaved: bool):
    """``(..., r/2)`` per pair -> ``C``, ``S`` ``(..., r)`` per dim: the first dim of pair ``i``
    gets ``(cos_i, -sin_i)``, the second ``(cos_i, +sin_i)``."""
    if interleaved:  # pairs (2i, 2i+1)
        C = torch.stack((cos, cos), dim=-1).flatten(-2)  # (..., r/2, 2) -> (..., r)
        S = torch.stack((-sin, sin), dim=-1).flatten(-2)  # (..., r/2, 2) -> (..., r)
    else:  # pairs (i, i + r/2)
        C = torch.cat((cos, cos), dim=-1)  # (..., r)
        S = torch.cat((-sin, sin), dim=-1)  # (..., r)
    return C, S


def _rotate(x: torch.Tensor, C: torch.Tensor, S: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """``x * C + partner(x) * S`` on ``x``'s first ``r`` dims (``C``, ``S`` broadcastable to
    ``x[..., :r]``), in their dtype, rounded once to ``x``'s; the rest passes. For a pair
    ``(x1, x2)`` that is ``(x1 cos - x2 sin, x2 cos + x1 sin)``. One new tensor and two
    multiply-adds into its halves (no copy of the swapped pairs: each temporary of a large
    call is fresh memory the kernel must fault in); a small call of halves (up to
    ``_ROLL_MAX`` elements: a decode step) multiply-adds its halves rolled, in one op (the
    same products and sums, so the same values, at a third of the small ops). Shapes below are for ``x (B, H, T, d)``;
    ``(B, T, H, d)`` goes the same way."""
    r = C.shape[-1]
    xr = x[..., :r].to(C.dtype)  # (B, H, T, r)
    # eager only: under torch.compile / export the size test would fix a symbolic T
    if not interleaved and not torch.compiler.is_compiling() and xr.numel() <= _ROLL_MAX:
        # partner(x): the halves swapped
        y = torch.addcmul(xr * C, xr.roll(r // 2, -1), S).to(x.dtype)  # (B, H, T, r)
        return y if r == x.shape[-1] else torch.cat((y, x[..., r:]), dim=-1)  # (B, H, T, d)
    if interleaved:  # pairs (2i, 2i+1)
        one, two = (..., slice(0, r, 2)), (..., slice(1, r, 2))  # (B, H, T, r/2) views each
    else:  # pairs (i, i + r/2)
        one, two = (..., slice(0, r // 2)), (..., slice(r // 2, r))
    y = xr * C  # (B, H, T, r)
    y[one].addcmul_(xr[two], S[one])  # x1 cos - x2 sin
    y[two].addcmul_(xr[one], S[two])  # x2 cos + x1 sin
    y = y.to(x.dtype)
    if r == x.shape[-1]:
        return y
    return torch.cat((y, x[..., r:]), dim=-1)  # (B, H, T, r) + (B, H, T, d - r) -> (B, H, T, d)


def _check_x(x, dim: int, expected: str) -> None:
    check_tensor("x", x, 4, expected)
    if x.shape[-1] < dim:
        raise ValueError(f"x must have a head dim d >= the rotary dim {dim}, got "
                         f"{tuple(x.shape)}")


def check_positions(positions, B: int, T: int, device: torch.device) -> torch.Tensor:
    """``positions``: ints ``(T,)`` or ``(B, T)`` on ``device``, >= 0 (the values are checked
    outside ``torch.compile`` / ``torch.export``, where a traced program has only shapes:
    ``0 <= p <= MAX_POSITION``). Returned as int64 (a narrower dtype would index the tables as a
    mask, or not at all); refusals name ``positions``."""
    # sizes are formatted only in the errors: formatting a traced size fixes it to a constant
    positions = check_int_tensor("positions", positions, "(T,) or (B, T)", device)
    shape = positions.shape  # compared dim by dim: a traced B or T stays symbolic
    if not (positions.dim() == 1 and shape[0] == T or positions.dim() == 2 and shape[1] == T
            and (shape[0] == B or shape[0] == 1)):
        raise ValueError(f"positions must have shape (T,) = ({T},) or (B, T) = ({B}, {T}), got "
                         f"{tuple(positions.shape)}")
    if positions.device != device:
        raise ValueError(f"positions must be on {device} like the inputs, got {positions.device}")
    if not torch.compiler.is_compiling():
        check_readable("positions", positions)
        if positions.numel():
            lo, hi = (int(v) for v in torch.aminmax(positions))  # one pass over the values
            if lo < 0:
                raise ValueError(f"positions must be >= 0, got a minimum of {lo}")
            if hi > MAX_POSITION:
                raise ValueError(f"positions must be < 2**31 (MAX_POSITION = {MAX_POSITION}), "
                                 f"got a maximum of {hi}")
    return positions.long()


def _check_scaling(scaling) -> tuple | None:
    """None, or transformers' ``rope_parameters`` dict -> ``(("rope_type", t), (key, v), ...)``."""
    if scaling is None:
        return None
    if isinstance(scaling, tuple):  # already normalised (dataclasses.replace, copies)
        scaling = dict(scaling)
    if not isinstance(scaling, dict):
        raise TypeError(f"scaling must be None or a dict with 'rope_type' "
                        f"{' / '.join(map(repr, SCALINGS))}, got {type(scaling).__name__}")
    kind = scaling.get("rope_type", scaling.get("type"))
    if "rope_type" in scaling and "type" in scaling and scaling["type"] != kind:
        raise ValueError(f"scaling: rope_type {kind!r} and type {scaling['type']!r} (its older "
                         f"spelling) disagree; give one of them")
    if not isinstance(kind, str | None):  # a list or dict would not even hash
        raise ValueError(f"scaling: rope_type must be one of {sorted(SCALINGS)} (or None for "
                         f"none), got {type(kind).__name__} {kind!r}")
    if kind in (None, "default") and set(scaling) <= {"rope_type", "type", "rope_theta",
                                                      "partial_rotary_factor"}:
        return None
    if kind not in SCALINGS:
        raise ValueError(f"scaling: rope_type must be one of {sorted(SCALINGS)} (or None for "
                         f"none), got {kind!r}")
    missing = [k for k in SCALINGS[kind] if k not in scaling]
    if missing:
        raise ValueError(f"scaling: rope_type {kind!r} needs {list(SCALINGS[kind])}; "
                         f"missing {missing}")
    extra = sorted(set(scaling) - set(SCALINGS[kind])
                   - {"rope_type", "type", "rope_theta", "partial_rotary_factor"})
    if extra:
        raise ValueError(f"scaling: unknown keys {extra} for rope_type {kind!r} "
                         f"(expected {list(SCALINGS[kind])})")
    values = {k: check_scalar(f"scaling[{k!r}]", scaling[k], low=0.0) for k in SCALINGS[kind]}
    if any(v == 0.0 for v in values.values()):
        raise ValueError(f"scaling: every value must be > 0, got {values}")
    if kind == "llama3" and not values["high_freq_factor"] > values["low_freq_factor"]:
        raise ValueError(f"scaling: high_freq_factor must exceed low_freq_factor, got "
                         f"{values['high_freq_factor']} and {values['low_freq_factor']}")
    return (("rope_type", kind),) + tuple(sorted(values.items()))


def as_rotary(rope, head_dim: int) -> Rotary | None:
    """The module's ``rope=`` argument: None / False (off), True (``Rotary(head_dim)``) or a
    :class:`Rotary` whose ``dim`` fits ``head_dim``; refusals name ``rope``."""
    if rope is None or rope is False:
        return None
    if rope is True:
        return Rotary(head_dim)
    if not isinstance(rope, Rotary):
        raise TypeError(f"rope must be None, True (Rotary(head_dim)) or a mha.rope.Rotary, got "
                        f"{type(rope).__name__}")
    if rope.dim > head_dim:
        raise ValueError(f"rope: Rotary.dim={rope.dim} exceeds head_dim={head_dim} (the rotated "
                         f"dims are the first dim of each query / key head)")
    return rope
