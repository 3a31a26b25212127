"""The benchmark child: one matmul test on one device, one JSON object on stdout.

Run as `python -m collectors.benchmark.child --device 0 --profile fp32 --size 2048`. This is the only
gpuwarden module that imports torch, and it does so inside `main()`. The daemon never imports
this module: what parent and child share (the profiles, the request, its arguments) is in
collectors/benchmark/request.py. A CUDA context costs about 800 MB of
GPU memory until its process exits (docs/MEASUREMENTS.md), so it lives only in this short-lived child.

The test follows the field guide's script (docs/MEASUREMENTS.md, "The benchmark record") and keeps its record
fields: random inputs, warm-up, `samples` timed windows of `iterations` products each, the
median window, 2·n³·iterations / median as TFLOP/s. Two additions: a minimum window (short bursts
read faster than sustained work, so `iterations` grows until one window lasts `min_window_seconds`)
and a correctness check of part of the product against a float64 reference.

Output: exactly one line of JSON on stdout, either a record (exit 0, also for a wrong answer: the
parent judges) or `{"error": KIND, "message": ...}` with exit code 2 (bad arguments), 3 (no usable
device: torch missing, CUDA unavailable, driver too old, no such device), 4 (out of memory) or
5 (any other failure).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, NoReturn

from collectors.benchmark.request import PROFILES, Request

if TYPE_CHECKING:  # torch only ever loads inside main()
    import torch

RECORD_VERSION: Final = 1
PLANT_WRONG_RESULT_ENV: Final = "GPUWARDEN_BENCH_PLANT_WRONG_RESULT"
"""Test-only: set to 1 and the child corrupts one block of the product before checking it."""

EXIT_OK: Final = 0
EXIT_USAGE: Final = 2
EXIT_NO_DEVICE: Final = 3
EXIT_OUT_OF_MEMORY: Final = 4
EXIT_ERROR: Final = 5

CHECK_BANDS: Final = 16
"""The product is cut into this many row bands; one random row of each is checked in full, so
every (row band x column) tile of the output has a checked row in it. A fault that corrupts a
tile (a bad SM, a bad memory page under a tile) is caught; one wrong element elsewhere may not be."""

MAX_ITERATIONS: Final = 1_000_000


class ChildFailure(Exception):
    def __init__(self, kind: str, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.exit_code = exit_code


def classify_failure(exc: BaseException) -> ChildFailure:
    """An exception from torch -> a failure kind a person and the parent can act on."""
    text = f"{type(exc).__name__}: {exc}"
    lower = text.lower()
    if isinstance(exc, ChildFailure):
        return exc
    if "outofmemoryerror" in lower or "out of memory" in lower or "can't allocate memory" in lower:
        return ChildFailure("out_of_memory", text, EXIT_OUT_OF_MEMORY)
    if "too old" in lower or "driver version is insufficient" in lower:
        return ChildFailure("driver_too_old", text, EXIT_NO_DEVICE)
    if any(
        s in lower
        for s in (
            "not compiled with cuda",
            "no nvidia driver",
            "no cuda gpus",
            "cuda driver initialization failed",
            "cuda unavailable",
        )
    ):
        return ChildFailure("cuda_unavailable", text, EXIT_NO_DEVICE)
    if "invalid device ordinal" in lower:
        return ChildFailure("device_not_found", text, EXIT_NO_DEVICE)
    return ChildFailure("error", text, EXIT_ERROR)


class _JsonArgumentParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        _print({"error": "invalid_argument", "message": message})
        sys.exit(EXIT_USAGE)


def parse_request(argv: Sequence[str]) -> Request:
    parser = _JsonArgumentParser(prog="python -m collectors.benchmark.child")
    parser.add_argument("--device", default="0", help="cpu, N or cuda:N")
    parser.add_argument("--profile", choices=sorted(PROFILES), default="fp32")
    parser.add_argument("--size", type=int, default=None, help="matrix side; default per profile")
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--samples", type=int, default=5)
    parser.add_argument(
        "--min-window",
        type=float,
        default=0.0,
        help="seconds one timed window must last at least (0: as the guide)",
    )
    args = parser.parse_args(argv)
    profile = PROFILES[args.profile]
    size = profile.default_size if args.size is None else args.size
    if not profile.min_size <= size <= profile.max_size:
        parser.error(
            f"size {size} is outside {profile.min_size}-{profile.max_size} for "
            f"the {profile.name} profile"
        )
    if not 1 <= args.iterations <= MAX_ITERATIONS:
        parser.error(f"iterations must be 1-{MAX_ITERATIONS}")
    if not 0 <= args.warmup <= 1000 or not 1 <= args.samples <= 100:
        parser.error("warmup must be 0-1000 and samples 1-100")
    if not 0.0 <= args.min_window <= 60.0:
        parser.error("min-window must be 0-60 seconds")
    device = args.device.strip().lower()
    if device.isdigit():
        device = f"cuda:{device}"
    if device == "cuda":
        device = "cuda:0"
    if device != "cpu" and not (device.startswith("cuda:") and device[5:].isdigit()):
        parser.error(f"device {args.device!r}: expected cpu, N or cuda:N")
    return Request(
        device, profile, size, args.iterations, args.warmup, args.samples, args.min_window
    )


def _print(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj, ensure_ascii=False, allow_nan=False) + "\n")
    sys.stdout.flush()


def _open_device(torch: Any, request: Request) -> torch.device:
    device = torch.device(request.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            try:  # is_available() hides the reason; init() raises with it (driver too old, ...)
                torch.cuda.init()
            except Exception as exc:
                raise classify_failure(exc) from exc
            raise ChildFailure("cuda_unavailable", "torch reports CUDA unavailable", EXIT_NO_DEVICE)
        count = torch.cuda.device_count()
        if not 0 <= (device.index or 0) < count:
            raise ChildFailure(
                "device_not_found",
                f"{request.device}: this process sees {count} CUDA device(s)",
                EXIT_NO_DEVICE,
            )
        torch.cuda.set_device(device)
    return device  # type: ignore[no-any-return]


def _device_facts(torch: Any, device: torch.device) -> dict[str, Any]:
    if device.type != "cuda":
        return {"gpu_name": "cpu", "gpu_uuid": None}
    props = torch.cuda.get_device_properties(device)
    raw_uuid = getattr(props, "uuid", None)
    uuid_text = f"GPU-{raw_uuid}" if raw_uuid is not None else None
    return {"gpu_name": props.name, "gpu_uuid": uuid_text}


@dataclass(frozen=True)
class _Operands:
    torch: Any
    device: torch.device
    x: torch.Tensor
    y: torch.Tensor
    out: torch.Tensor

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)

    def timed_window(self, iterations: int) -> float:
        """Seconds for `iterations` products, from an idle device to an idle device."""
        mm = self.torch.mm
        self.synchronize()
        start = time.perf_counter()
        for _ in range(iterations):
            mm(self.x, self.y, out=self.out)
        self.synchronize()
        return time.perf_counter() - start


def _calibrate(operands: _Operands, request: Request) -> int:
    """Iterations per window so that one window lasts at least `min_window_seconds`."""
    iterations = request.iterations
    for _ in range(8):
        if request.min_window_seconds <= 0:
            break
        seconds = operands.timed_window(iterations)
        if seconds >= request.min_window_seconds or iterations >= MAX_ITERATIONS:
            break
        # 10% headroom so that the windows that follow, which vary a little, stay above it.
        factor = 1.1 * request.min_window_seconds / max(seconds, 1e-6)
        iterations = min(MAX_ITERATIONS, max(iterations * 2, math.ceil(iterations * factor)))
    return iterations


def _measure(operands: _Operands, request: Request) -> tuple[int, list[float]]:
    """The timed windows. If their median came out under the minimum window (the calibration
    pass ran slow: cold caches, clocks still rising), scale up and measure again."""
    iterations = _calibrate(operands, request)
    for _ in range(3):
        samples = [operands.timed_window(iterations) for _ in range(request.samples)]
        median = statistics.median(samples)
        if median >= request.min_window_seconds or iterations >= MAX_ITERATIONS:
            break
        factor = 1.1 * request.min_window_seconds / max(median, 1e-6)
        iterations = min(MAX_ITERATIONS, math.ceil(iterations * factor))
    return iterations, samples


def check_product(
    torch: Any, x: torch.Tensor, y: torch.Tensor, out: torch.Tensor, rng: random.Random
) -> tuple[float | None, int]:
    """Worst |C - C_ref| / (|A|·|B|) over one random full row per band; None if not finite."""
    n = out.shape[0]
    bands = min(CHECK_BANDS, n)
    band = n // bands
    rows = [b * band + rng.randrange(band) for b in range(bands)]
    index = torch.tensor(rows, device=out.device)
    got = out.index_select(0, index).double()
    if not bool(torch.isfinite(got).all()):
        return None, len(rows)
    x_rows = x.index_select(0, index).double()
    y64 = y.double()
    reference = x_rows @ y64
    bound = x_rows.abs() @ y64.abs()
    errors = (got - reference).abs() / bound.clamp_min(torch.finfo(torch.float64).tiny)
    return float(errors.max().item()), len(rows)


def _plant_wrong_block(out: torch.Tensor, rng: random.Random) -> None:
    """Test-only: negate one (row band x column band) tile, as a faulty SM might produce."""
    n = out.shape[0]
    bands = min(CHECK_BANDS, n)
    band = n // bands
    row, col = rng.randrange(bands) * band, rng.randrange(bands) * band
    out[row : row + band, col : col + band].neg_()


def run(request: Request) -> dict[str, Any]:
    started = time.monotonic()
    try:
        import torch  # noqa: PLC0415 - only here: importing this module (tests do) loads none
    except ImportError as exc:
        raise ChildFailure("torch_missing", f"cannot import torch: {exc}", EXIT_NO_DEVICE) from exc
    device = _open_device(torch, request)
    facts = _device_facts(torch, device)
    profile = request.profile
    dtype = getattr(torch, profile.dtype)
    torch.set_float32_matmul_precision(profile.matmul_precision)
    seed = random.SystemRandom().randrange(2**31)
    rng = random.Random(seed)  # noqa: S311 - picks rows to check, not a secret
    torch.manual_seed(seed)
    size = request.size
    with torch.inference_mode():
        x = torch.randn(size, size, device=device, dtype=dtype)
        y = torch.randn(size, size, device=device, dtype=dtype)
        out = torch.empty_like(x)
        operands = _Operands(torch, device, x, y, out)
        for _ in range(request.warmup):
            torch.mm(x, y, out=out)
        iterations, samples = _measure(operands, request)
        if os.environ.get(PLANT_WRONG_RESULT_ENV) == "1":
            _plant_wrong_block(out, rng)
        max_error, checked_rows = check_product(torch, x, y, out, rng)
    median = statistics.median(samples)
    correct = max_error is not None and max_error <= profile.tolerance
    return {
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "gpu_index": device.index if device.type == "cuda" else None,
        "gpu_name": facts["gpu_name"],
        "torch": str(torch.__version__),
        "torch_cuda": torch.version.cuda,
        "dtype": profile.dtype,
        "matmul_precision": profile.matmul_precision,
        "size": size,
        "iterations": iterations,
        "median_seconds": median,
        "estimated_tflops": 2 * size**3 * iterations / median / 1e12,
        "record_version": RECORD_VERSION,
        "profile": profile.name,
        "device": request.device,
        "gpu_uuid": facts["gpu_uuid"],
        "warmup": request.warmup,
        "sample_seconds": samples,
        "min_window_seconds": request.min_window_seconds,
        "correct": correct,
        "max_error": max_error,
        "tolerance": profile.tolerance,
        "checked_rows": checked_rows,
        "seed": seed,
        "child_seconds": time.monotonic() - started,
    }


def main(argv: Sequence[str] | None = None) -> int:
    request = parse_request(sys.argv[1:] if argv is None else argv)
    try:
        record = run(request)
    except Exception as exc:
        failure = classify_failure(exc)
        _print({"error": failure.kind, "message": failure.message})
        return failure.exit_code
    _print(record)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
