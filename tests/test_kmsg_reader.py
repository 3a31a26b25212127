"""The /dev/kmsg reader on the device's real semantics: one record per read, EINVAL on a short
buffer, EAGAIN at the end, EPIPE on overwrite; and no replay across restarts."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from agent.contracts.collector import MemoryKeyValueStore
from agent.contracts.errors import StateStoreError
from agent.runtime.state import StateStore
from collectors.kernel_log.kmsg import (
    KMSG_CURSOR_KEY,
    STATE_NAMESPACE,
    FileLogReader,
    HandedOn,
    KernelLogError,
    KmsgReader,
    OsKmsgIO,
)
from collectors.kernel_log.matchers import MatcherSet
from tests.support.kmsg import (
    FakeKmsg,
    capture_records,
    kmsg_record,
    sequence_gaps,
    write_boot_id,
)

XID79 = "NVRM: Xid (PCI:0000:3b:00): 79, pid=2314, name=python3, GPU has fallen off the bus."
BOOT_A = "d83a7ca0-7bd3-4bb6-a80e-b2731eaa11e8"
BOOT_B = "0b6e2f1c-5a4d-4e3b-9c2a-1f0e9d8c7b6a"


def h200_device() -> FakeKmsg:
    """The H200 capture's records plus two planted Xids, as the ring buffer would hold them."""
    device = FakeKmsg.with_records(capture_records())
    device.write(XID79, fields=[("SUBSYSTEM", "pci"), ("DEVICE", "+pci:0000:3b:00.0")])
    device.write("NVRM: Xid (PCI:0000:86:00): 13, pid=4411, name=train.py, Graphics Exception")
    return device


def reader_for(
    device: FakeKmsg, boot_id_path: Path, state: MemoryKeyValueStore | StateStore, **kwargs: object
) -> KmsgReader:
    return KmsgReader(Path("/dev/kmsg"), boot_id_path, state, io=device, **kwargs)  # type: ignore[arg-type]


class TestFakeDevice:
    """The stand-in behaves like /dev/kmsg, so the reader is tested against the real rules."""

    def test_semantics(self) -> None:
        """One record per read; a short buffer is EINVAL; the end is EAGAIN; overwrite is EPIPE."""
        device = FakeKmsg.with_records([kmsg_record(0, "a"), kmsg_record(1, "b" * 100)])
        fd = device.open("/dev/kmsg")
        assert device.read(fd, 8192) == kmsg_record(0, "a")
        with pytest.raises(OSError, match="Invalid argument"):
            device.read(fd, 16)
        assert device.read(fd, 8192).startswith(b"4,1,")
        with pytest.raises(BlockingIOError):
            device.read(fd, 8192)
        device.write("c")
        device.write("d")
        device.overwrite_oldest(3)
        fd2 = device.open("/dev/kmsg")
        with pytest.raises(OSError, match="Broken pipe"):
            device.read(fd, 8192)
        assert device.read(fd, 8192) == device.read(fd2, 8192) == kmsg_record(3, "d")


class TestReading:
    """Records come out whole, in order; overruns and losses are counted."""

    def test_h200_capture_with_planted_xids(self, tmp_path: Path) -> None:
        """Every record of the capture is read, the planted Xids last, one read each."""
        device = h200_device()
        reader = reader_for(
            device, write_boot_id(tmp_path / "boot_id", BOOT_A), MemoryKeyValueStore()
        )
        batch = reader.read()
        assert len(batch.records) == len(device.records)
        assert batch.records[-2].message == XID79
        assert batch.records[-2].fields["DEVICE"] == "+pci:0000:3b:00.0"
        assert batch.predates_agent
        # The capture was saved with a few records left out: the reader reports those as lost.
        assert batch.lost == sequence_gaps(device.records) > 0
        assert (batch.overruns, batch.malformed) == (0, 0)
        assert device.reads == len(device.records) + 1  # the last read is the EAGAIN
        assert device.einval == 0
        reader.commit(batch)
        second = reader.read()
        assert second.records == []
        assert not second.predates_agent

    def test_backlog_longer_than_one_round(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A backlog read over several rounds is all marked predates_agent; what follows is not."""
        monkeypatch.setattr("collectors.kernel_log.kmsg.MAX_RECORDS_PER_READ", 100)
        device = h200_device()
        reader = reader_for(
            device, write_boot_id(tmp_path / "boot_id", BOOT_A), MemoryKeyValueStore()
        )
        batches = []
        for _ in range(4):
            batches.append(reader.read())
            reader.commit(batches[-1])  # handed on: the next read goes on from it
        assert [len(b.records) for b in batches] == [100, 100, 100, len(device.records) - 300]
        assert all(b.predates_agent for b in batches)
        device.write("INFO: task python3:1 blocked for more than 120 seconds.")
        later = reader.read()
        assert len(later.records) == 1
        assert not later.predates_agent

    def test_short_buffer_is_a_clear_error(self, tmp_path: Path) -> None:
        """A buffer too small for a record fails loudly, naming the cause (it would loop)."""
        device = FakeKmsg.with_records([kmsg_record(0, "x" * 200)])
        reader = reader_for(
            device, write_boot_id(tmp_path / "boot_id", BOOT_A), MemoryKeyValueStore(), read_size=64
        )
        with pytest.raises(KernelLogError, match="EINVAL"):
            reader.read()

    def test_overrun_is_counted_and_reading_continues(self, tmp_path: Path) -> None:
        """EPIPE: the overwritten records are counted as lost, the rest is read."""
        device = FakeKmsg.with_records([kmsg_record(i, f"r{i}") for i in range(5)])
        reader = reader_for(
            device, write_boot_id(tmp_path / "boot_id", BOOT_A), MemoryKeyValueStore()
        )
        first = reader.read()
        assert len(first.records) == 5
        reader.commit(first)
        for i in range(5, 15):
            device.write(f"r{i}")
        device.overwrite_oldest(8)  # r5 .. r7 were never read
        batch = reader.read()
        assert [r.message for r in batch.records] == [f"r{i}" for i in range(8, 15)]
        assert (batch.overruns, batch.lost) == (1, 3)

    def test_user_space_records_carry_their_facility(self, tmp_path: Path) -> None:
        """A record written by a root process arrives with facility 1 and is not from_kernel."""
        device = FakeKmsg()
        device.write(XID79, facility=1, level=6)
        reader = reader_for(
            device, write_boot_id(tmp_path / "boot_id", BOOT_A), MemoryKeyValueStore()
        )
        [record] = reader.read().records
        assert record.facility == 1
        assert not record.from_kernel

    def test_missing_boot_id_is_a_clear_error(self, tmp_path: Path) -> None:
        """Without a boot id the reader refuses, saying what to set."""
        reader = reader_for(h200_device(), tmp_path / "absent", MemoryKeyValueStore())
        with pytest.raises(KernelLogError, match="boot_id_path"):
            reader.read()


class TestRestart:
    """A restart on the same boot replays nothing; a new boot reads from the start."""

    def test_same_boot_no_replay(self, tmp_path: Path) -> None:
        """After commit and restart, only records written since are read, and they say they
        predate this process."""
        store = StateStore.open(tmp_path / "state")
        boot = write_boot_id(tmp_path / "boot_id", BOOT_A)
        device = h200_device()
        first = reader_for(device, boot, store)
        batch = first.read()
        first.commit(batch)
        first.close()
        assert store.get(STATE_NAMESPACE, KMSG_CURSOR_KEY) == {
            "boot_id": BOOT_A,
            "seq": device.next_seq - 1,
        }
        device.write("NVRM: Xid (PCI:0000:3b:00): 48, DBE while the agent was down")
        store.close()

        store = StateStore.open(tmp_path / "state")
        again = reader_for(device, boot, store)
        batch = again.read()
        assert [r.message for r in batch.records] == [
            "NVRM: Xid (PCI:0000:3b:00): 48, DBE while the agent was down"
        ]
        assert batch.predates_agent
        assert batch.skipped == len(device.records) - 1
        again.commit(batch)
        store.close()

        store = StateStore.open(tmp_path / "state")
        third = reader_for(device, boot, store)
        assert third.read().records == []
        store.close()

    def test_uncommitted_batch_is_read_again(self, tmp_path: Path) -> None:
        """A crash before commit loses nothing: the records come back after a restart."""
        state = MemoryKeyValueStore()
        boot = write_boot_id(tmp_path / "boot_id", BOOT_A)
        device = h200_device()
        assert reader_for(device, boot, state).read().records
        assert len(reader_for(device, boot, state).read().records) == len(device.records)

    @pytest.mark.parametrize("more", [0, 3])
    def test_a_batch_never_committed_is_read_again_by_the_same_reader(
        self, tmp_path: Path, more: int
    ) -> None:
        """Its round failed or its call timed out: the next read gives its records again
        (and what came since), not only what came since; none counted lost or skipped."""
        state = MemoryKeyValueStore()
        boot = write_boot_id(tmp_path / "boot_id", BOOT_A)
        device = FakeKmsg.with_records([kmsg_record(i, f"r{i}") for i in range(4)])
        reader = reader_for(device, boot, state)
        reader.commit(reader.read())
        for i in range(4, 8):
            device.write(f"r{i}")
        dropped = reader.read()
        for i in range(8, 8 + more):
            device.write(f"r{i}")
        again = reader.read()
        assert [r.seq for r in again.records] == [r.seq for r in dropped.records] + list(
            range(8, 8 + more)
        )
        assert (again.lost, again.skipped, again.overruns) == (0, 0, 0)
        reader.commit(again)
        assert reader.read().records == []

    def test_new_boot_reads_from_the_start(self, tmp_path: Path) -> None:
        """A different boot id: the ring buffer is all new, even with lower sequence numbers."""
        state = MemoryKeyValueStore()
        boot = write_boot_id(tmp_path / "boot_id", BOOT_A)
        device = h200_device()
        reader = reader_for(device, boot, state)
        reader.commit(reader.read())
        write_boot_id(boot, BOOT_B)
        rebooted = FakeKmsg.with_records([kmsg_record(i, f"after reboot {i}") for i in range(3)])
        batch = reader_for(rebooted, boot, state).read()
        assert [r.seq for r in batch.records] == [0, 1, 2]
        assert batch.skipped == 0
        assert batch.lost == 0

    def test_records_lost_while_down_are_counted(self, tmp_path: Path) -> None:
        """Records written and overwritten while the agent was stopped count as lost."""
        state = MemoryKeyValueStore()
        boot = write_boot_id(tmp_path / "boot_id", BOOT_A)
        device = FakeKmsg.with_records([kmsg_record(i, f"r{i}") for i in range(3)])
        reader = reader_for(device, boot, state)
        reader.commit(reader.read())
        for i in range(3, 10):
            device.write(f"r{i}")
        device.overwrite_oldest(6)  # r3 .. r5 never read
        batch = reader_for(device, boot, state).read()
        assert batch.lost == 3
        assert [r.seq for r in batch.records] == [6, 7, 8, 9]


def garbled(seq: int) -> bytes:
    """A record the kernel numbered whose header does not parse (a priority out of range)."""
    return f"9999,{seq},0,-;garbled {seq}\n".encode()


def ring_with_garbled(size: int, garbled_at: set[int]) -> FakeKmsg:
    return FakeKmsg.with_records(
        garbled(seq) if seq in garbled_at else kmsg_record(seq, f"r{seq}") for seq in range(size)
    )


PLACES = [
    pytest.param({0}, id="first"),
    pytest.param({3}, id="middle"),
    pytest.param({6}, id="last"),
    pytest.param({2, 3}, id="two-together"),
    pytest.param({0, 6}, id="both-ends"),
]


class TestRecordsCountedOnce:
    """A record that does not parse is malformed, once: not also lost (its number is no gap
    in the sequence), and not again when a reader the process makes anew (a reload) reads the
    ring from its start; nor is a record the process already handed on skipped again."""

    @pytest.mark.parametrize("garbled_at", PLACES)
    def test_a_garbled_record_is_malformed_and_not_lost(
        self, tmp_path: Path, garbled_at: set[int]
    ) -> None:
        boot = write_boot_id(tmp_path / "boot_id", BOOT_A)
        device = ring_with_garbled(7, garbled_at)
        batch = reader_for(device, boot, MemoryKeyValueStore()).read()
        assert (batch.malformed, batch.lost, batch.skipped) == (len(garbled_at), 0, 0)
        assert [r.seq for r in batch.records] == sorted(set(range(7)) - garbled_at)
        assert batch.cursor == {"boot_id": BOOT_A, "seq": 6}  # past a garbled last record

    @pytest.mark.parametrize("garbled_at", PLACES)
    @pytest.mark.parametrize("reloads", [1, 3])
    def test_a_reader_made_again_counts_nothing_twice(
        self, tmp_path: Path, garbled_at: set[int], reloads: int
    ) -> None:
        boot = write_boot_id(tmp_path / "boot_id", BOOT_A)
        device = ring_with_garbled(7, garbled_at)
        state, handed_on = MemoryKeyValueStore(), HandedOn()
        totals = {"records": 0, "malformed": 0, "lost": 0, "skipped": 0}
        for life in range(reloads + 1):
            reader = reader_for(device, boot, state, handed_on=handed_on, backlog=life == 0)
            batch = reader.read()
            for name, value in (
                ("records", len(batch.records)),
                ("malformed", batch.malformed),
                ("lost", batch.lost),
                ("skipped", batch.skipped),
            ):
                totals[name] += value
            reader.commit(batch)
            reader.close()
            device.write(f"after reader {life}")
        written = 7 + reloads + 1
        reader = reader_for(device, boot, state, handed_on=handed_on, backlog=False)
        last = reader.read()
        assert (len(last.records), last.malformed, last.skipped) == (1, 0, 0)
        totals["records"] += 1
        assert totals == {
            "records": written - len(garbled_at),
            "malformed": len(garbled_at),
            "lost": 0,
            "skipped": 0,
        }

    def test_a_restart_still_counts_the_replay_skipped(self, tmp_path: Path) -> None:
        """A new process (its own `HandedOn`) skips what the last one handed on, and says so."""
        boot = write_boot_id(tmp_path / "boot_id", BOOT_A)
        device = ring_with_garbled(7, {3})
        state = MemoryKeyValueStore()
        first = reader_for(device, boot, state, handed_on=HandedOn())
        first.commit(first.read())
        batch = reader_for(device, boot, state, handed_on=HandedOn()).read()
        assert (batch.records, batch.malformed, batch.skipped) == ([], 0, 7)


class TestFileSource:
    """A file of saved lines is read like tail -f, without replay after a restart."""

    def test_tail_and_restart(self, tmp_path: Path) -> None:
        """New complete lines only; a half-written line waits; a replaced file starts over."""
        log = tmp_path / "kern.log"
        log.write_text(f"[   1.0] first\n[   2.0] {XID79}\n[   3.0] half")
        state = MemoryKeyValueStore()
        reader = FileLogReader(log, state)
        batch = reader.read()
        assert [r.line for r in batch.records] == [1, 2]
        assert batch.predates_agent
        reader.commit(batch)
        with log.open("a") as handle:
            handle.write(" done\n")
        batch = reader.read()
        assert [(r.line, r.message) for r in batch.records] == [(3, "half done")]
        reader.commit(batch)
        restarted = FileLogReader(log, state)
        assert restarted.read().records == []
        replacement = tmp_path / "new.log"
        replacement.write_text("[   9.0] rotated\n")
        os.replace(replacement, log)
        assert [r.message for r in restarted.read().records] == ["rotated"]

    def test_batch_not_committed_is_read_again(self, tmp_path: Path) -> None:
        """A read whose batch was never handed on (the call outlived its timeout and the
        runtime dropped the result, or the round failed) loses nothing: the next read gives
        the same records; after commit, only what is new."""
        log = tmp_path / "kern.log"
        log.write_text(f"[   1.0] first\n[   2.0] {XID79}\n")
        reader = FileLogReader(log, MemoryKeyValueStore())
        dropped = reader.read()
        again = reader.read()
        assert [(r.line, r.message) for r in again.records] == [(1, "first"), (2, XID79)]
        assert again.records == dropped.records
        assert again.predates_agent
        reader.commit(again)
        with log.open("a") as handle:
            handle.write("[   3.0] third\n")
        assert [(r.line, r.message) for r in reader.read().records] == [(3, "third")]

    def test_failed_cursor_write_does_not_read_the_batch_again(self, tmp_path: Path) -> None:
        """The batch was handed on even if saving the cursor failed: no second copy."""
        log = tmp_path / "kern.log"
        log.write_text(f"[   1.0] {XID79}\n")

        class FullDisk(MemoryKeyValueStore):
            def put(self, namespace: str, key: str, value: object) -> None:
                raise StateStoreError("database or disk is full")

        reader = FileLogReader(log, FullDisk())
        batch = reader.read()
        with pytest.raises(StateStoreError):
            reader.commit(batch)
        assert reader.read().records == []

    def test_reads_are_bounded(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        """Each read takes at most FILE_READ_BYTES and MAX_RECORDS_PER_READ lines, says there
        is more, and the reads together give every line once, numbered in file order."""
        monkeypatch.setattr("collectors.kernel_log.kmsg.FILE_READ_BYTES", 4096)
        monkeypatch.setattr("collectors.kernel_log.kmsg.MAX_RECORDS_PER_READ", 50)
        log = tmp_path / "kern.log"
        log.write_text(
            "".join(f"[{i:8d}.000000] line {i} {'x' * (i % 70)}\n" for i in range(1, 2001))
        )
        reader = FileLogReader(log, MemoryKeyValueStore())
        seen: list[tuple[int, str]] = []
        backlog: list[bool] = []
        batches = 0
        while True:
            batch = reader.read()
            reader.commit(batch)
            batches += 1
            backlog.append(batch.predates_agent)
            assert len(batch.records) <= 50
            seen += [(r.line, r.message.split(" ")[1]) for r in batch.records]
            if not batch.more:
                break
        assert seen == [(i, str(i)) for i in range(1, 2001)]
        assert batches >= log.stat().st_size // 4096
        assert backlog == [True] * batches  # the whole file was there before the agent
        with log.open("a") as handle:
            handle.write("[    2001.0] new\n")
        later = reader.read()
        assert ([r.line for r in later.records], later.predates_agent) == ([2001], False)

    def test_line_longer_than_a_read_is_counted_once(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A line without a newline longer than a read (or than any kernel record) is counted
        as malformed once, skipped across reads without being read again, and the lines after
        it keep their numbers; a restart in the middle of it goes on skipping."""
        monkeypatch.setattr("collectors.kernel_log.kmsg.FILE_READ_BYTES", 4096)
        monkeypatch.setattr("collectors.kernel_log.lines.MAX_LINE_BYTES", 1024)
        log = tmp_path / "kern.log"
        log.write_bytes(b"[   1.0] before\n" + b"z" * 20_000)
        state = MemoryKeyValueStore()
        reader = FileLogReader(log, state)
        first = reader.read()
        assert ([r.message for r in first.records], first.malformed) == (["before"], 1)
        reader.commit(first)
        offsets: list[object] = []
        for _ in range(3):  # the writer is still writing the long line: skip, do not count
            batch = reader.read()
            reader.commit(batch)
            assert (batch.records, batch.malformed) == ([], 0)
            assert batch.cursor is not None
            offsets.append(batch.cursor["offset"])
        assert offsets == [8192, 12288, 16384]  # each read moves on by a whole read
        with log.open("ab") as handle:
            handle.write(b"z" * 9000 + f"\n[   3.0] {XID79}\n[   4.0] last\n".encode())
        restarted = FileLogReader(log, state)
        records = []
        while True:
            batch = restarted.read()
            restarted.commit(batch)
            assert batch.malformed == 0
            records += batch.records
            if not batch.more:
                break
        assert [(r.line, r.message) for r in records] == [(3, XID79), (4, "last")]

    def test_indented_lines_keep_their_records_trust_across_reads(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A user-space message of many lines, longer than a read, stays user space in the
        next read; after a restart inside it, its further lines are not trusted either."""
        monkeypatch.setattr("collectors.kernel_log.kmsg.FILE_READ_BYTES", 256)
        pad = " " * 20
        log = tmp_path / "kern.log"
        log.write_text(
            "Nov 29 18:10:02 gpu-host-17 python3[42]: a long message\n"
            + "".join(f"{pad}line {i} of it\n" for i in range(12))
            + f"{pad}{XID79}\n"
        )
        state = MemoryKeyValueStore()
        reader = FileLogReader(log, state)
        first = reader.read()
        reader.commit(first)
        assert first.more
        restarted = FileLogReader(log, state)
        records = []
        while True:
            batch = restarted.read()
            restarted.commit(batch)
            records += batch.records
            if not batch.more:
                break
        assert records
        assert not any(r.from_kernel for r in first.records + records)
        assert records[-1].message == XID79
        matchers = MatcherSet()
        assert list(matchers.scan(records)) == []
        assert matchers.ignored["xid"] == 1

    def test_only_newline_ends_a_line(self, tmp_path: Path) -> None:
        """\\r, \\x0b, \\x0c, \\x1c-\\x1e, \\x85 and U+2028/9 inside a line are text: one
        record per line, line numbers are the newline count (a CRLF file loses only the \\r)."""
        inner = "\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"
        text = (
            "".join(f"[   {i}.0] rec {i}{inner}tail\n" for i in range(1, 6))
            + f"[   6.0] {XID79}\r\n"
        )
        log = tmp_path / "kern.log"
        log.write_text(text, encoding="utf-8", newline="")
        batch = FileLogReader(log, MemoryKeyValueStore()).read()
        assert [r.line for r in batch.records] == [1, 2, 3, 4, 5, 6]
        assert [r.message for r in batch.records][:5] == [
            f"rec {i}{inner}tail" for i in range(1, 6)
        ]
        assert batch.records[5].message == XID79

    def test_missing_file_is_a_clear_error(self, tmp_path: Path) -> None:
        """A path that does not exist fails the round with the path in the message."""
        with pytest.raises(KernelLogError, match=r"absent\.log"):
            FileLogReader(tmp_path / "absent.log", MemoryKeyValueStore()).read()


def _kmsg_readable() -> bool:
    try:
        os.close(os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK))
    except OSError:
        return False
    return Path("/proc/sys/kernel/random/boot_id").exists()


@pytest.mark.skipif(not _kmsg_readable(), reason="/dev/kmsg is not readable here")
class TestRealDevice:
    """This machine's own /dev/kmsg, read for real."""

    def test_reads_real_records(self) -> None:
        """Records parse, sequence numbers rise, the kernel's records have facility 0, and a
        second reader with the committed cursor reads nothing old."""
        state = MemoryKeyValueStore()
        boot = Path("/proc/sys/kernel/random/boot_id")
        reader = KmsgReader(Path("/dev/kmsg"), boot, state, io=OsKmsgIO())
        batch = reader.read()
        reader.close()
        assert batch.records
        assert batch.malformed == 0
        seqs = [r.seq or 0 for r in batch.records]
        assert seqs == sorted(seqs)
        assert any(r.facility == 0 for r in batch.records)
        reader.commit(batch)
        again = KmsgReader(Path("/dev/kmsg"), boot, state, io=OsKmsgIO())
        later = again.read()
        again.close()
        assert all((r.seq or 0) > seqs[-1] for r in later.records)
        assert later.skipped >= len(batch.records) - later.lost
