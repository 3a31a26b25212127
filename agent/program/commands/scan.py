"""List the findings in a saved kernel log: Xids, SXids, GPUs fallen off the bus, disk, file
system and NVMe errors, OOM kills and hung tasks, each with its meaning and what to do.

FILE may be raw /dev/kmsg records, `dmesg` (also -T, -r, -x, --json, --time-format iso),
`journalctl` (any short output mode, with or without host names; json, json-seq, json-sse,
json-pretty, export, verbose), a syslog file (RFC 5424 too), or a journal file itself (shapes
may be mixed; `-` reads standard input); compressed with gzip, bzip2, xz or zstd, as
logrotate leaves it.
Lines that are not findings print nothing; malformed lines are counted and skipped; a line
with an unreadable timestamp is still read. Lines that say they were written from user space
(facility >= 1, a program's name instead of `kernel:`) are not trusted as findings and are
counted instead. The file is read in bounded pieces: any size will do.

Exit codes: 0 no findings (info findings alone, such as all-clears, are clean); 1 findings,
none worse than warning, or a kernel record journalctl did not print (saved without --all);
2 a critical (or fatal) finding, or the file could not be read to its end.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import stat
import sys
import textwrap
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import BinaryIO, TextIO

from agent.contracts.model import Severity
from agent.program import output
from collectors._xid_catalog import CatalogError, catalog
from collectors.kernel_log.matchers import Finding, MatcherSet
from collectors.kernel_log.parse import (
    LogRecord,
    MalformedLine,
    ParseStats,
    indented,
    parse_line,
    parse_lines,
)
from collectors.kernel_log.saved import ReadNotes, SavedLogError, saved_lines
from collectors.kernel_log.stamps import timeline

EXIT_CLEAN = 0
EXIT_WARNINGS = 1
EXIT_CRITICAL = 2


def catalog_line() -> str:
    """Which catalog judges the findings; a broken catalog file is named, not a crash of
    every command that builds this parser."""
    try:
        line = f"Findings are judged with the {catalog().describe()}."
    except CatalogError as exc:
        line = f"The Xid catalog cannot be read: {exc}"
    return textwrap.fill(line, 90)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = catalog_line()
    parser.add_argument("file", metavar="FILE", help="saved kernel log ('-' for standard input)")
    parser.add_argument(
        "--json", action="store_true", help="one JSON object per finding, one per line"
    )
    parser.add_argument(
        "--all",
        dest="every",
        action="store_true",
        help="list every finding (default: a summary per GPU, kind, code and severity when "
        "they would fill more than a screen)",
    )


def scan_lines(
    lines: Iterable[str | None],
    stats: ParseStats | None = None,
    matchers: MatcherSet | None = None,
) -> list[Finding]:
    """Every finding in saved log lines, in line order.

    Most lines of a real log are noise: a line that holds none of the matchers' trigger words
    costs one search and is counted, never parsed (it cannot hold a finding, nor break or
    complete a message over several lines: the matchers measure distance in positions, each
    within its own numbering, sequence numbers or line numbers: collectors/kernel_log/finding.py).
    So `stats.malformed` counts the malformed lines among those that could hold a finding.
    """
    matchers = matchers if matchers is not None else MatcherSet()
    stats = stats if stats is not None else ParseStats()
    return list(matchers.scan(_candidate_records(lines, stats, matchers)))


def _candidate_records(
    lines: Iterable[str | None], stats: ParseStats, matchers: MatcherSet
) -> Iterator[LogRecord]:
    """Parsed records of the lines that can matter, each run of them parsed together (so a
    raw record keeps its ` KEY=value` continuation lines) with its own line numbers. A line
    too long to keep (None) goes to the parser, which counts it as malformed. A run that
    starts with an indented line continues the record whose first line was skipped: that
    line is parsed too, for the run's trust (a process's message cannot make its second line
    the kernel's by keeping the trigger words off its first)."""
    candidate = matchers.candidate_line
    run: list[str | None] = []
    start = skipped = 0
    head: str | None = None  # the last line that starts a record
    previous: LogRecord | None = None
    for number, text in enumerate(lines, 1):
        further = text is not None and text[:1] == " " and indented(text)
        if text is None or candidate(text) or (run and further):
            if not run:
                start = number
                previous = _head_record(head) if further else None
            run.append(text)
            if not further:
                head = text
            continue
        skipped += 1
        if not further:
            head = text
        if run:
            yield from parse_lines(run, stats, first_line=start, previous=previous)
            run = []
    if run:
        yield from parse_lines(run, stats, first_line=start, previous=previous)
    stats.lines += skipped


def _head_record(text: str | None) -> LogRecord | None:
    if text is None:
        return None
    try:
        return parse_line(text)
    except MalformedLine:
        return None


def scan_stream(
    stream: BinaryIO,
    stats: ParseStats | None = None,
    matchers: MatcherSet | None = None,
    name: str = "-",
    notes: ReadNotes | None = None,
) -> list[Finding]:
    """Every finding in a saved log read from `stream` in bounded chunks, lines cut at `\\n`
    only (collectors/kernel_log/lines.py), decompressed and a journal's export read as it
    goes (collectors/kernel_log/saved.py; what it saw goes in `notes`)."""
    return scan_lines(saved_lines(stream, name, notes), stats, matchers)


def exit_code(findings: Sequence[Finding]) -> int:
    """By the worst finding; info alone (an all-clear, a corrected PCIe error) is clean."""
    worst = max((f.severity for f in findings), default=Severity.INFO)
    if worst >= Severity.CRITICAL:
        return EXIT_CRITICAL
    return EXIT_WARNINGS if worst >= Severity.WARNING else EXIT_CLEAN


def _where(finding: Finding) -> str:
    parts = [finding.pci_bus_id, finding.device]
    if finding.process or finding.pid is not None:
        parts.append(f"{finding.process or '?'}[{finding.pid if finding.pid is not None else '?'}]")
    return " ".join(p for p in parts if p) or "-"


def _what(finding: Finding) -> str:
    if finding.kind in ("xid", "sxid") and finding.code is not None:
        return f"{finding.kind} {finding.code}"
    return finding.kind


def _meaning(finding: Finding) -> str:
    return f"{finding.name}: {finding.meaning}" if finding.name else finding.meaning


SEVERITY_COLOUR = {
    Severity.INFO: "",
    Severity.WARNING: output.YELLOW,
    Severity.CRITICAL: output.RED,
    Severity.FATAL: output.RED,
}
TEXT_INDENT = 6
"""Meaning and action lines sit under the row, this far in: room for the text at any width."""


def _columns(rows: Sequence[Sequence[str]], header: Sequence[str]) -> list[int]:
    return [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]


def _text_lines(finding: Finding, columns: int, colour: bool) -> list[str]:
    pad = " " * TEXT_INDENT
    lines = [pad + line for line in output.wrap(_meaning(finding), columns - TEXT_INDENT)]
    action = output.wrap(
        finding.action, columns - TEXT_INDENT, output.paint("action:", output.BOLD, colour) + " ", 8
    )
    return lines + [pad + line for line in action]


def table_lines(findings: Sequence[Finding], columns: int, colour: bool) -> list[str]:
    """Every finding: its row (line, severity, kind, where), then what it means and what to
    do, wrapped under it."""
    header = ("LINE", "SEVERITY", "KIND", "WHERE")
    rows = [(str(f.line), f.severity.label, _what(f), _where(f)) for f in findings]
    widths = _columns(rows, header)

    def fmt(cells: Sequence[str], severity: Severity | None = None) -> str:
        label = cells[1].ljust(widths[1])
        rest = [c.ljust(w) for c, w in zip(cells[2:], widths[2:], strict=True)]
        # Fitted before it is painted: a cut never falls inside a colour code.
        tail = output.fit("  ".join(rest).rstrip(), max(columns - widths[0] - widths[1] - 4, 1))
        if severity is not None:
            label = output.paint(label, SEVERITY_COLOUR[severity], colour)
        return "  ".join([cells[0].rjust(widths[0]), label, tail])

    lines = [fmt(header)]
    for finding, row in zip(findings, rows, strict=True):
        lines.append(fmt(row, finding.severity))
        lines += _text_lines(finding, columns, colour)
    return lines


def _when(finding: Finding) -> str:
    record = finding.record
    if record.timestamp:
        return f" [{record.timestamp}]"
    if record.monotonic_usec is not None:
        return f" [{record.monotonic_usec / 1e6:.6f} s after boot]"
    return ""


def _group_key(finding: Finding) -> tuple[str, str, int, Severity]:
    """Per GPU (or device) x kind x code x severity, as the summary counts them."""
    return (
        finding.pci_bus_id or finding.device or "-",
        finding.kind,
        finding.code or 0,
        finding.severity,
    )


def summary_lines(findings: Sequence[Finding], columns: int, colour: bool) -> list[str]:
    """One block per GPU x kind x code x severity: how often, first and last seen, what it
    means and what to do, once."""
    groups: dict[tuple[str, str, int, Severity], list[Finding]] = {}
    for finding in findings:
        groups.setdefault(_group_key(finding), []).append(finding)
    ordered = sorted(groups.values(), key=lambda g: (-g[0].severity, g[0].line))
    lines = output.wrap(
        f"{len(findings)} findings in {len(groups)} group(s), worst first; "
        "gpuwarden scan --all lists every one.",
        columns,
    )
    header = ("SEVERITY", "KIND", "WHERE", "COUNT")
    rows = [
        (
            g[0].severity.label,
            _what(g[0]),
            _group_key(g[0])[0],
            f"{len(g)} time{'s' if len(g) > 1 else ''}",
        )
        for g in ordered
    ]
    widths = _columns(rows, header)
    for group, row in zip(ordered, rows, strict=True):
        first, last = group[0], group[-1]
        label = output.paint(row[0].ljust(widths[0]), SEVERITY_COLOUR[first.severity], colour)
        cells = [c.ljust(w) for c, w in zip(row[1:], widths[1:], strict=True)]
        lines += ["", "  ".join([label, *cells]).rstrip()]
        seen = f"first line {first.line}{_when(first)}"
        if len(group) > 1:
            seen += f", last line {last.line}{_when(last)}"
        lines += [" " * TEXT_INDENT + line for line in output.wrap(seen, columns - TEXT_INDENT)]
        lines += _text_lines(first, columns, colour)
    return lines


def print_findings(findings: Sequence[Finding], out: TextIO, every: bool) -> None:
    """The table when it fits a screen (or `every`, or when no two findings would share a
    summary line), else the summary."""
    columns, colour = output.width(out), output.use_colour(out)
    screen = output.rows(out)
    groups = len({_group_key(f) for f in findings})
    if every or len(findings) <= screen or groups == len(findings):
        lines = table_lines(findings, columns, colour)
        if not every and len(lines) > screen and groups < len(findings):
            lines = summary_lines(findings, columns, colour)
    else:
        lines = summary_lines(findings, columns, colour)
    for line in lines:
        print(line, file=out)


def summary_text(findings: Sequence[Finding], stats: ParseStats, matchers: MatcherSet) -> str:
    """The counts, always all of them: a reader knows nothing was dropped unsaid."""
    notes = [f"{stats.malformed} malformed line(s) skipped"]
    if stats.malformed:
        notes[0] += f", first at line {stats.malformed_examples[0][0]}"
    if stats.bad_timestamps:
        notes.append(f"{stats.bad_timestamps} record(s) with an unreadable timestamp, read")
    if stats.left_out:
        notes.append(
            f"{stats.left_out} kernel record(s) whose message journalctl did not print "
            "(`[blob data]` or null): save the log again with `journalctl --all`"
        )
    if stats.holes:
        notes.append(f"{stats.holes} line(s) with NUL bytes, the text around them read")
    ignored = sum(matchers.ignored.values())
    if ignored:
        notes.append(f"{ignored} finding(s) from user-space lines ignored (facility >= 1)")
    else:
        notes.append("0 user-space line(s) ignored")
    return f"{len(findings)} finding(s) in {stats.lines} line(s) ({'; '.join(notes)})"


def _open(name: str) -> BinaryIO:
    # Bytes, not text: a text stream would end lines at \r as well as \n.
    if name == "-":
        return sys.stdin.buffer
    return Path(name).open("rb")


def saved_at(handle: BinaryIO) -> float:
    """When the saved log was last written (its modification time), the reference for its
    year-less stamps; now for a pipe or a terminal."""
    try:
        info = os.fstat(handle.fileno())
    except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
        return time.time()
    return info.st_mtime if stat.S_ISREG(info.st_mode) else time.time()


def json_lines(findings: Sequence[Finding], reference: float) -> Iterator[str]:
    """One JSON object per finding, with `time` (seconds since the epoch) where its line's
    stamp says one (collectors/kernel_log/stamps.py; a year-less stamp's year from the lines
    after it and `reference`)."""
    times = timeline([finding.record for finding in findings], reference)
    for finding, when in zip(findings, times, strict=True):
        out = finding.to_dict()
        if when is not None:
            out["time"] = round(when, 6)
        yield json.dumps(out, sort_keys=True)


def main(args: argparse.Namespace) -> int:
    stats, matchers, notes = ParseStats(), MatcherSet(), ReadNotes()
    try:
        handle = _open(args.file)
        with handle:
            reference = saved_at(handle)
            findings = scan_stream(handle, stats, matchers, args.file, notes)
    except OSError as exc:
        reason = exc.strerror or str(exc)
        print(f"gpuwarden scan: cannot read {args.file}: {reason}", file=sys.stderr)
        return EXIT_CRITICAL
    except SavedLogError as exc:
        print(f"gpuwarden scan: {exc}", file=sys.stderr)
        return EXIT_CRITICAL
    try:
        if args.json:
            for line in json_lines(findings, reference):
                print(line)
        elif findings:
            print_findings(findings, sys.stdout, args.every)
        sys.stdout.flush()
    except BrokenPipeError:  # `gpuwarden scan ... | head`: the reader left; the code still counts
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    for line in output.wrap(summary_text(findings, stats, matchers), output.width(sys.stderr)):
        print(line, file=sys.stderr)
    for problem in notes.problems:
        for line in output.wrap(
            f"gpuwarden scan: {args.file}: {problem}", output.width(sys.stderr)
        ):
            print(line, file=sys.stderr)
    if notes.problems:
        return EXIT_CRITICAL  # not read to its end: a clean result would say what it cannot
    code = exit_code(findings)
    return max(code, EXIT_WARNINGS) if stats.left_out else code
