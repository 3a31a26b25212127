"""The statvfs helper: a small child process that answers statvfs requests, one at a time.

Run by collectors/disk/isolated.py as `python -I -S statvfs_child.py` (standard library only:
it starts in milliseconds and needs no import path). The protocol is one JSON line each way:

    request:  "/mnt/nfs"                       (the path, a JSON string)
    answer:   {"v": [f_bsize, f_frsize, f_blocks, f_bfree, f_bavail, f_files, f_ffree,
                     f_favail, f_flag, f_namemax]}
              {"errno": 2, "error": "No such file or directory"}

A statvfs on a dead file server blocks this process, not the agent: the agent stops waiting,
gives this child up, and can always exit. End of input (the agent gone) ends the helper.
"""

from __future__ import annotations

import json
import os
import sys


def answer(path: str) -> dict[str, object]:
    try:
        st = os.statvfs(path)
    except OSError as exc:
        return {"errno": exc.errno or 0, "error": exc.strerror or str(exc)}
    return {"v": list(st)}


def main() -> None:
    for line in sys.stdin:
        try:
            path = json.loads(line)
        except ValueError:
            path = None
        reply = (
            answer(path)
            if isinstance(path, str)
            else {"errno": 0, "error": f"not a JSON string: {line[:80]!r}"}
        )
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
