"""What a matcher yields (`Finding`), what a matcher is (`Matcher`), and `OpenRecords`: the
bookkeeping for messages the kernel or a driver writes over several lines.

A multi-line message arrives either as one record with newlines in it (one printk: /dev/kmsg
keeps it whole) or as several records or saved lines next to each other (`dmesg` prints one
line per newline; a driver that calls printk once per line). A matcher holds the first line's
finding open, adds what the following lines say, and hands it on when a line comes that is too
far away to belong to it, or when the reader has nothing more for now (`settle`).

Distance is counted in the records' own numbers (a saved line's number, a raw record's
sequence number), never in records seen: `MatcherSet` does not feed a matcher the records that
hold none of its trigger words, so a count of records fed would not say what lies between.
A file can mix the two numberings (raw records pasted among dmesg lines), and a sequence
number minus a line number says nothing: a record of the other numbering is no evidence of
distance, it neither ends a held message nor joins one (`Position`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Final, Generic, NamedTuple, Protocol, TypeVar

from agent.contracts.model import AttributeValue, RepairAction, Severity
from collectors._xid import normalize_pci_bus_id
from collectors.kernel_log.parse import LogRecord

# Any PCI device's address as the kernel prints it: Intel VMD puts the devices behind it in
# domains from 10000.
ANY_BDF: Final = r"[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]"


@dataclass(frozen=True, slots=True)
class Finding:
    """Something in the log a person should know about, with what it means and what to do."""

    kind: str
    severity: Severity
    meaning: str
    action: str
    record: LogRecord
    pci_bus_id: str = ""
    """Normalised (`0000:3b:00.0`), or empty when the line names none or names it badly."""
    device: str = ""
    process: str = ""
    pid: int | None = None
    code: int | None = None
    """The Xid or SXid code."""
    name: str = ""
    """A short name: the catalog's for an Xid, the fault's for the others."""
    repair_action: RepairAction = RepairAction.NONE
    """What must be done, as data (agent/contracts/model.py); every matcher sets it."""
    clears: tuple[str, ...] = ()
    """Kinds this finding clears for its subject (Xid 154 to None: `*`), see Event.clears."""
    attributes: dict[str, AttributeValue] = field(default_factory=dict)

    @property
    def line(self) -> int:
        return self.record.line

    @property
    def subject(self) -> str:
        return self.pci_bus_id or self.device or (str(self.pid) if self.pid else "") or self.kind

    def to_dict(self) -> dict[str, AttributeValue]:
        out: dict[str, AttributeValue] = {
            "kind": self.kind,
            "severity": self.severity.label,
            "meaning": self.meaning,
            "action": self.action,
            "repair_action": self.repair_action.value,
            "line": self.line,
            "message": self.record.message,
        }
        if self.kind in ("xid", "sxid"):
            out["xid"] = self.code
        if self.name:
            out["name"] = self.name
        for key, value in (
            ("pci_bus_id", self.pci_bus_id),
            ("device", self.device),
            ("process", self.process),
        ):
            if value:
                out[key] = value
        if self.pid is not None:
            out["pid"] = self.pid
        if self.record.timestamp:
            out["timestamp"] = self.record.timestamp
        out.update(self.attributes)
        return out


class Matcher(Protocol):
    """Reads records in order; may hold a finding open for the lines that follow it.

    `triggers`: substrings one of which every record this matcher acts on contains. A record
    with none of them can neither yield a finding nor change the matcher's state, so
    `MatcherSet` (and `gpuwarden scan`, before it even parses a line) skips such records: the
    matcher's logic must not depend on seeing them.
    """

    @property
    def triggers(self) -> tuple[str, ...]: ...

    def feed(self, record: LogRecord) -> Iterable[Finding]: ...

    def settle(self) -> Iterable[Finding]:
        """No more records for now (a live read's batch ended): hand on what is held open.
        A follow-up line that arrives later is known as one, not raised again."""
        ...

    def flush(self) -> Iterable[Finding]:
        """The end of a stream (a file's end): hand on what is held, forget what was seen."""
        ...


def _kept(words: Iterable[str]) -> list[str]:
    # A word that contains another is left out: the shorter one finds it.
    unique = sorted(set(words), key=len)
    return [t for i, t in enumerate(unique) if not any(s in t for s in unique[:i])]


def _overlap(a: str, b: str) -> bool:
    """Whether an occurrence of `a` can run into one of `b` (a suffix of one is a prefix of the
    other): then one non-overlapping pass could hide the second."""
    return any(b.startswith(a[i:]) or a.startswith(b[i:]) for i in range(1, len(a)))


_Trie = dict[str, "_Trie"]
_END: Final = ""


def trie_pattern(words: Sequence[str]) -> str:
    """An alternation of `words` (none a prefix of another: `_kept` words) as a trie, `Link
    (?:Down|Up)` for `Link Down|Link Up`. At each place in a line the engine tries the
    alternatives of a branch one by one: as a trie it tries one per first character, not one
    per word (`gpuwarden scan` read a third faster with 62 words; docs/MEASUREMENTS.md)."""
    trie: _Trie = {}
    for word in words:
        node = trie
        for char in word:
            node = node.setdefault(char, {})
        node[_END] = {}
    return _branch(trie)


def _branch(node: _Trie) -> str:
    parts = []
    for first, after in node.items():
        if first == _END:
            continue
        text, rest = first, after
        while len(rest) == 1 and _END not in rest:  # a run with one way on: one literal
            ((char, rest),) = rest.items()
            text += char
        parts.append(re.escape(text) + ("" if list(rest) == [_END] else _branch(rest)))
    if _END in node and parts:
        parts.append("")  # a word ends here and others go on (not with `_kept` words)
    return parts[0] if len(parts) == 1 else "(?:" + "|".join(parts) + ")"


def trigger_search(triggers: Iterable[str]) -> Callable[[str], re.Match[str] | None]:
    """One regular expression's search for "holds one of these words"."""
    return re.compile(trie_pattern(_kept(triggers))).search


Owner = TypeVar("Owner")


class TriggerIndex(Generic[Owner]):
    """Which owners (matchers, rules) a message concerns, from one pass over it: the owners of
    the trigger words it holds, in the owners' order."""

    def __init__(self, owners: Sequence[tuple[Owner, Iterable[str]]]) -> None:
        self.owners = [owner for owner, _ in owners]
        listed = [(i, list(words)) for i, (_, words) in enumerate(owners)]
        kept = _kept(w for _, words in listed for w in words)
        self._regex = re.compile(trie_pattern(kept))
        self._words = kept
        self._one_pass = not any(_overlap(a, b) for a in kept for b in kept if a != b)
        by_word: dict[str, set[int]] = {}
        for i, words in listed:
            for word in words:
                for k in kept:
                    if k in word:
                        by_word.setdefault(k, set()).add(i)
        self._by_word = {k: sorted(v) for k, v in by_word.items()}

    def search(self, text: str) -> bool:
        return self._regex.search(text) is not None

    def hits(self, text: str) -> list[Owner]:
        if self._one_pass:
            words = {m[0] for m in self._regex.finditer(text)}
        else:
            words = {w for w in self._words if w in text}
        if not words:
            return []
        if len(words) == 1:
            indices = self._by_word[words.pop()]
        else:
            indices = sorted({i for w in words for i in self._by_word[w]})
        return [self.owners[i] for i in indices]


def pci_or_empty(text: str | None) -> str:
    if not text:
        return ""
    try:
        return normalize_pci_bus_id(text)
    except ValueError:
        return ""


SEQ: Final = "seq"
LINE: Final = "line"


class Position(NamedTuple):
    """Where a record stands, in one of two numberings: `SEQ` (a raw record's sequence number,
    in a file or live: continuation lines between them do not count) or `LINE` (a saved line's
    number); `scheme` empty when unknown (a record made without either)."""

    scheme: str
    value: int


UNKNOWN: Final = Position("", 0)


def position(record: LogRecord) -> Position:
    if record.seq is not None:
        return Position(SEQ, record.seq)  # seq 0 is the boot's first record, a real place
    return Position(LINE, record.line) if record.line > 0 else UNKNOWN


def distance(since: Position, here: Position) -> int | None:
    """How many places `here` lies after `since`; None when they count in two numberings (a
    sequence number minus a line number means nothing). Two unknown positions are 0 apart."""
    return here.value - since.value if since.scheme == here.scheme else None


def arrival(record: LogRecord) -> int:
    """The order records come in, for sorting findings: a file's line number (whatever the
    record's numbering), or the sequence number of a live record (whose line it is)."""
    return record.line or record.seq or 0


def number(text: str | None) -> int | None:
    return int(text) if text else None


class Built(Protocol):
    def finding(self) -> Finding: ...


B = TypeVar("B", bound=Built)


@dataclass
class _Open(Generic[B]):
    state: B
    last: Position
    """Position of its latest line."""
    seen: int
    """Records fed when its latest line came: the distance when positions are unknown."""


class OpenRecords(Generic[B]):
    """Records being assembled, by key, and the keys of those handed on lately.

    `advance` is called once per record fed; it closes (and returns the findings of) every open
    record whose latest line lies more than `reach` positions back in the current record's
    numbering (one of the other numbering stays open: `near` and `get` refuse it). A key closed within `reach`
    is remembered, so a follow-up line that comes after its record was handed on (a live batch
    ended between them) is recognised and absorbed instead of raised as a new finding.
    """

    def __init__(self, reach: int) -> None:
        self.reach = reach
        self.open: dict[Hashable, _Open[B]] = {}
        self._closed: dict[Hashable, tuple[Position, int]] = {}
        self._seen = 0
        self._record: LogRecord | None = None
        self._position: Position | None = UNKNOWN

    @property
    def _here(self) -> Position:
        """The current record's position, worked out when first needed (most records fed
        find nothing open)."""
        if self._position is None:
            self._position = position(self._record) if self._record is not None else UNKNOWN
        return self._position

    def _near(self, last: Position, seen: int) -> bool | None:
        """Whether the current record is within reach of `last`; None when nothing says (the
        two count in different numberings): such a record neither closes nor joins."""
        here = self._here
        if not last.scheme or not here.scheme:
            return self._seen - seen <= self.reach
        apart = distance(last, here)
        return None if apart is None else 0 <= apart <= self.reach

    def advance(self, record: LogRecord) -> list[Finding]:
        self._seen += 1
        self._record, self._position = record, None
        if not self.open and not self._closed:
            return []
        out = [
            self.close(key)
            for key, held in list(self.open.items())
            if self._near(held.last, held.seen) is False
        ]
        for key, (last, seen) in list(self._closed.items()):
            if self._near(last, seen) is False:
                del self._closed[key]
        return [f for f in out if f is not None]

    def near(self, key: Hashable) -> bool:
        """An open or lately closed record of this key is within reach of the current record."""
        held = self.open.get(key)
        if held is not None:
            return self._near(held.last, held.seen) is True
        closed = self._closed.get(key)
        return closed is not None and self._near(*closed) is True

    def get(self, key: Hashable) -> B | None:
        """The open record of this key that the current record can belong to (None for one
        of the other numbering: it stays open, for the records of its own)."""
        held = self.open.get(key)
        if held is None or self._near(held.last, held.seen) is not True:
            return None
        return held.state

    def hold(self, key: Hashable, state: B) -> list[Finding]:
        """Open a record (closing and returning one of the same key that was open)."""
        previous = self.close(key)
        self.open[key] = _Open(state, self._here, self._seen)
        return [previous] if previous is not None else []

    def extend(self, key: Hashable) -> None:
        """The current record belongs to this key's open (or lately closed) record."""
        if key in self.open:
            self.open[key].last, self.open[key].seen = self._here, self._seen
        elif key in self._closed:
            self._closed[key] = (self._here, self._seen)

    def close(self, key: Hashable) -> Finding | None:
        held = self.open.pop(key, None)
        if held is None:
            return None
        self._closed[key] = (held.last, held.seen)
        return held.state.finding()

    def drop(self, key: Hashable) -> None:
        """Forget an open record: another finding stands for it."""
        held = self.open.pop(key, None)
        if held is not None:
            self._closed[key] = (held.last, held.seen)

    def settle(self) -> list[Finding]:
        out = [self.close(key) for key in list(self.open)]
        return [f for f in out if f is not None]

    def reset(self) -> None:
        self.open.clear()
        self._closed.clear()

    def flush(self) -> list[Finding]:
        """The end of a log: every open record's finding, and nothing remembered after."""
        found = self.settle()
        self.reset()
        return found


class Assembling(Generic[B]):
    """A matcher whose findings span several records, held in `_open` until complete: its
    `settle` and `flush` are those of its open records."""

    _open: OpenRecords[B]

    def settle(self) -> list[Finding]:
        return self._open.settle()

    def flush(self) -> list[Finding]:
        return self._open.flush()


@dataclass
class Ready:
    """An open record whose finding is already known in full (only absorbs follow-ups)."""

    built: Finding

    def finding(self) -> Finding:
        return self.built
