"""Can the installed torch use this driver? Run as a script in a child interpreter.

`gpuwarden check` runs this file (by path, with the interpreter it is asked to judge), so the
agent never imports torch: the import alone takes about 500 MB of host memory and a CUDA context
about 800 MB of GPU memory (docs/MEASUREMENTS.md). Prints one JSON object on stdout. Only the standard
library is imported at the top, so any Python that has torch can run it.
"""

import json
import os
import warnings
from typing import Any


def probe() -> dict[str, Any]:
    out: dict[str, Any] = {"pid": os.getpid()}
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                import torch  # noqa: PLC0415 - only here, in the child, and it may be missing
            except ImportError as exc:
                out["missing"] = str(exc)
            else:
                out["version"] = torch.__version__
                out["cuda_build"] = torch.version.cuda
                out["available"] = bool(torch.cuda.is_available())
                if out["available"]:
                    count = torch.cuda.device_count()
                    out["device_count"] = count
                    out["arch_list"] = torch.cuda.get_arch_list()
                    out["capabilities"] = [
                        list(torch.cuda.get_device_capability(i)) for i in range(count)
                    ]
                    x = torch.ones(4, device="cuda")
                    out["op_ok"] = float((x + 1).sum().item()) == 8.0
        out["warnings"] = sorted({str(w.message).splitlines()[0] for w in caught})
    except Exception as exc:  # every failure is the answer, never a traceback
        out["error"] = f"{type(exc).__name__}: {exc}"
    return out


if __name__ == "__main__":
    print(json.dumps(probe()))
