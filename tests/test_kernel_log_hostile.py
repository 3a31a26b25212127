"""A hostile line costs the reader time in proportion to its length, never more.

A saved log can hold lines of up to 64 KiB (collectors/kernel_log/lines.py), a followed syslog
file carries what any local user passes to `logger`, and a kernel record is up to 8 KiB. A
regular expression that backtracks over the whole line from each place it could start costs
the square of the length: a 16 KiB line then took seconds in one matcher (a minute at 64 KiB),
time in which the collector reads nothing else.

Every trigger word of every matcher, with fills chosen to make a pattern backtrack (runs of
word characters, digits, colons, addresses, the pattern's own words), before and after the
trigger and repeated with it, read as `gpuwarden scan` reads a line. The bound is per line and
far from both sides: a linear scan of 16 KiB takes a millisecond or two here, a quadratic one
seconds.
"""

from __future__ import annotations

import gc
import time

from agent.program.commands.scan import scan_lines
from collectors.kernel_log.lines import MAX_LINE_BYTES
from collectors.kernel_log.matchers import default_matchers
from collectors.kernel_log.parse import ParseStats
from tests.support.corpus import cases, scan

LENGTH = 16 * 1024
BOUND_S = 0.25
FILLS = (
    "a",
    "0",
    " ",
    ":",
    "a:",
    "(",
    "[",
    ", ",
    "0000:00:00.0 ",
    "task ",
    " on ",
    "MC0: 1 CE ",
    "nvidia 0000:41:00.0: ",
    "GPU 0000:41:00.0: ",
)


def _lines(trigger: str, fills: tuple[str, ...] = FILLS, length: int = LENGTH) -> list[str]:
    out = []
    for fill in fills:
        run = fill * (length // len(fill))
        out += [
            trigger + run,
            run + trigger,
            (trigger + fill) * (length // (len(trigger) + len(fill))),
        ]
    return out


def _timed(line: str) -> float:
    """CPU seconds of this thread to read one line (another job on this shared machine takes
    the core, not this thread's time), with the garbage collector off: late in the whole suite
    the heap is large, and a collection there (about 0.3 s in a clean-clone run) landed on
    whichever line was being read."""
    gc.disable()
    try:
        start = time.thread_time()
        scan_lines([line], ParseStats())
        return time.thread_time() - start
    finally:
        gc.enable()


def _slow(lines: list[str], length: int = LENGTH) -> list[str]:
    """The lines (cut to LENGTH) that took longer than BOUND_S to read, with the time. A line
    over the bound is read twice more and judged by its fastest read: a quadratic pattern is
    slow every time, while a moment of another job on this shared machine is not."""
    slow = []
    gc.collect()
    for line in lines:
        text = line[:length] + "\n"
        took = _timed(text)
        if took > BOUND_S:
            took = min(took, _timed(text), _timed(text))
        if took > BOUND_S:
            slow.append(f"{took:.2f} s: {line[:60]!r}...")
    return slow


def _found_messages() -> list[str]:
    """The message of every finding in the corpus: each pattern's own words, in full."""
    messages = set()
    for case in cases():
        for finding in case.expected["findings"]:
            messages.add(next(r.message for r in scan(case).records if r.line == finding["line"]))
    return sorted(messages)


def test_a_finding_repeated_to_the_length_of_a_line() -> None:
    """The words a pattern looks for, many times in one line: each occurrence must not cost a
    pass over the rest of the line."""
    messages = _found_messages()
    assert len(messages) > 50
    lines = [
        line
        for message in messages
        for line in (message * (LENGTH // len(message) + 1), message + " " + message[:-1] * 4000)
    ]
    assert _slow(lines) == []


def test_no_line_costs_more_than_its_length() -> None:
    triggers = sorted({t for matcher in default_matchers() for t in matcher.triggers})
    assert len(triggers) > 30  # every matcher's words, not a few
    assert _slow([line for trigger in triggers for line in _lines(trigger)]) == []


def test_the_longest_line_a_saved_log_keeps() -> None:
    """At the longest line a saved log or a followed file keeps (64 KiB), where a pattern
    that costs the square of the length takes seconds (a pattern with an unbounded run in its
    middle, tried from each place it could start: the hung-task and OOM-summary patterns took
    3 s on one such line), a linear one milliseconds. The fills that find such a pattern:
    word characters, digits and the words the patterns themselves hold."""
    triggers = sorted({t for matcher in default_matchers() for t in matcher.triggers})
    lines = [
        line
        for trigger in triggers
        for line in _lines(trigger, ("a", "0", "task "), MAX_LINE_BYTES)
    ]
    assert _slow(lines, MAX_LINE_BYTES) == []
