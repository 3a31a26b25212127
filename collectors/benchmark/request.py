"""What the benchmark's parent and child agree on: the profiles, one request, and the child's
command-line arguments that carry it.

The daemon imports this module, never collectors/benchmark/child.py: the child's module (its
argument parser, random inputs, statistics) runs only in its own short-lived process, and a
module the daemon imports stays resident for its life (issue 14, docs/MEASUREMENTS.md). Standard
library only, as the child is: it may run under another interpreter (`[collectors.benchmark]
python`, a torch environment without gpuwarden's dependencies).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final


@dataclass(frozen=True, slots=True)
class Profile:
    """A benchmark precision with its valid sizes and the error it may show when healthy.

    `tolerance` bounds |C - C_ref| / (|A|·|B|) element-wise, with C_ref and |A|·|B| computed in
    float64 from the very inputs used (already rounded to `dtype`). Sources of the numbers: the
    classic bound for a dot product of length K is K·u·(|a|·|b|), but rounding errors of a
    blocked GEMM are random and grow like sqrt(K)·u, which at K <= 16384 and unit roundoff u is
    far below these limits; a real fault (a wrong tile, a flipped exponent bit) is orders above.
    """

    name: str
    dtype: str
    matmul_precision: str
    default_size: int
    min_size: int
    max_size: int
    tolerance: float


PROFILES: Final[dict[str, Profile]] = {
    # Healthy errors measured on an H200 (torch 2.11+cu130) and on a CPU, against the bound
    # below: fp32 2e-7, tf32 3e-5, bf16 2e-4 (CPU 1e-3 at n=128), fp16 2e-5 (CPU 1e-4): every
    # tolerance has a margin of 10x or more; the planted wrong tile reads 1e-1 or more.
    # fp32 "highest": u = 2^-24 ≈ 6e-8. Sizes 128-4096 as in the field guide's smoke test.
    "fp32": Profile("fp32", "float32", "highest", 2048, 128, 4096, 1e-5),
    # TF32 ("high"): inputs rounded to a 10-bit mantissa, u = 2^-11 ≈ 4.9e-4 per product.
    "tf32": Profile("tf32", "float32", "high", 4096, 128, 16384, 1e-3),
    # bf16: 8-bit mantissa, u = 2^-8 ≈ 3.9e-3, and the output itself is rounded to bf16.
    "bf16": Profile("bf16", "bfloat16", "highest", 8192, 128, 16384, 1e-2),
    # fp16: 11-bit mantissa, u = 2^-11, output rounded to fp16.
    "fp16": Profile("fp16", "float16", "highest", 8192, 128, 16384, 5e-3),
}


@dataclass(frozen=True, slots=True)
class Request:
    device: str
    profile: Profile
    size: int
    iterations: int
    warmup: int
    samples: int
    min_window_seconds: float


def child_arguments(request: Request) -> list[str]:
    """The arguments that make the child (collectors/benchmark/child.py) run `request`."""
    return [
        "--device",
        request.device,
        "--profile",
        request.profile.name,
        "--size",
        str(request.size),
        "--iterations",
        str(request.iterations),
        "--warmup",
        str(request.warmup),
        "--samples",
        str(request.samples),
        "--min-window",
        repr(request.min_window_seconds),
    ]
