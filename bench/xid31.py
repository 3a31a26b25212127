"""Cause one real application-class Xid on GPU 0, safely: Xid 31 (an MMU fault).

A one-thread CUDA kernel writes to a device address nothing maps; the driver logs
`NVRM: Xid (PCI:...): 31, pid=..., name=python3, ... MMU Fault: ...` in the kernel log and NVML
delivers an Xid event. Only this process's CUDA context is lost (cudaErrorIllegalAddress); the
GPU needs no reset. Needs CuPy (it compiles the kernel with NVRTC at run time).

Prints one JSON line: the wall and monotonic time of the launch, and the CUDA error, so that a
caller (bench/xid_gpu_latency.py) can measure from the launch to its alert.

    python bench/xid31.py
"""

from __future__ import annotations

import json
import time

# An address in the canonical user range that no CUDA allocation of this process uses.
UNMAPPED = 0x7F0000000000

SOURCE = (
    f'extern "C" __global__ void fault(int *unused) {{ *((volatile int *){UNMAPPED:#x}ULL) = 1; }}'
)


def main() -> int:
    import cupy  # the GPU hosts' image has it; nothing else here needs it

    kernel = cupy.RawKernel(SOURCE, "fault")
    scratch = cupy.zeros(1, dtype=cupy.int32)
    cupy.cuda.Device().synchronize()  # the context is up before the clock starts
    wall, mono = time.time(), time.monotonic()
    try:
        kernel((1,), (1,), (scratch,))
        cupy.cuda.Device().synchronize()
    except Exception as exc:  # the fault is the point: report what CUDA said
        print(json.dumps({"launched_wall": wall, "launched_mono": mono, "error": str(exc)[:200]}))
        return 0
    print(json.dumps({"launched_wall": wall, "launched_mono": mono, "error": None}))
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
