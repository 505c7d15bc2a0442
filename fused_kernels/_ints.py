"""Integer helpers of the launch arithmetic, in plain Python: triton.cdiv and triton.next_power_of_2 cost
microseconds per call from the host (they are constexpr functions), and a launch computes several."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """a / b rounded up."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(n - 1, 0).bit_length()
