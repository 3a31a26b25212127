"""syslog(3)'s facility and level names and numbers, as the kernel log's shapes carry them
(collectors/kernel_log/parse.py and journal.py both read them)."""

from __future__ import annotations

from typing import Final

# syslog(3) facility names as `dmesg --decode` prints them, in facility-number order.
FACILITIES: Final = (
    "kern",
    "user",
    "mail",
    "daemon",
    "auth",
    "syslog",
    "lpr",
    "news",
    "uucp",
    "cron",
    "authpriv",
    "ftp",
    "res0",
    "res1",
    "res2",
    "res3",
    "local0",
    "local1",
    "local2",
    "local3",
    "local4",
    "local5",
    "local6",
    "local7",
)
LEVELS: Final = ("emerg", "alert", "crit", "err", "warn", "notice", "info", "debug")

KERNEL_FACILITY: Final = 0
USER_FACILITY: Final = 1
