"""Go's float64 arithmetic where Determined's searcher arithmetic depends on it.

Bracket and rung sizes truncate results of `math.Log` and `math.Pow` to integers, so a last-bit
difference changes a bracket: ln(1000)/ln(10) is 2.9999999999999996 with both libm and Go, which
truncates to 2, while other quotients land on either side of an integer depending on the log
used. `go_log` is Go's `math.Log` (FreeBSD's e_log.c as Go and its amd64 assembly compute it, in
the same operation order), `go_pow` is Go's `math.Pow` for the integer exponents the searchers
use, and `go_round` is `math.Round` (half away from zero, where Python's round() goes to even).
"""

from __future__ import annotations

import math

_LN2_HI = 6.93147180369123816490e-01
_LN2_LO = 1.90821492927058770002e-10
_L1 = 6.666666666666735130e-01
_L2 = 3.999999999940941908e-01
_L3 = 2.857142874366239149e-01
_L4 = 2.222219843214978396e-01
_L5 = 1.818357216161805012e-01
_L6 = 1.531383769920937332e-01
_L7 = 1.479819860511658591e-01
_SQRT2_HALF = math.sqrt(2) / 2


def go_log(x: float) -> float:
    """Go's math.Log(x), bit for bit."""
    if math.isnan(x) or x == math.inf:
        return x
    if x < 0:
        return math.nan
    if x == 0:
        return -math.inf
    f1, ki = math.frexp(x)
    if f1 < _SQRT2_HALF:
        f1 *= 2
        ki -= 1
    f = f1 - 1
    k = float(ki)
    s = f / (2 + f)
    s2 = s * s
    s4 = s2 * s2
    t1 = s2 * (_L1 + s4 * (_L3 + s4 * (_L5 + s4 * _L7)))
    t2 = s4 * (_L2 + s4 * (_L4 + s4 * _L6))
    r = t1 + t2
    hfsq = 0.5 * f * f
    return k * _LN2_HI - ((hfsq - (s * (hfsq + r) + k * _LN2_LO)) - f)


def go_pow(x: float, y: float) -> float:
    """Go's math.Pow(x, y) for finite x > 0 and an integer-valued y (successive squaring of
    the mantissa, as Go 1.22 computes it); other arguments fall back to Python's pow."""
    if y == 0 or x == 1:
        return 1.0
    if y == 1:
        return float(x)
    if not (math.isfinite(x) and x > 0 and math.isfinite(y) and y == int(y) and abs(y) < 2**62):
        return float(x**y)
    a1 = 1.0
    ae = 0
    x1, xe = math.frexp(x)
    i = int(abs(y))
    while i != 0:
        if xe < -(1 << 12) or xe > (1 << 12):
            ae += xe
            break
        if i & 1 == 1:
            a1 *= x1
            ae += xe
        x1 *= x1
        xe <<= 1
        if x1 < 0.5:
            x1 += x1
            xe -= 1
        i >>= 1
    if y < 0:
        a1 = 1 / a1
        ae = -ae
    try:
        return math.ldexp(a1, ae)
    except OverflowError:
        return math.inf


def go_round(x: float) -> float:
    """Go's math.Round: to the nearest integer, halves away from zero."""
    if not math.isfinite(x):
        return x
    t = float(math.trunc(x))
    if abs(x - t) >= 0.5:
        t += math.copysign(1.0, x)
    return t


def go_int(x: float) -> int:
    """Go's int(float64) conversion: truncation toward zero."""
    return int(x)
