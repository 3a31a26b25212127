"""The /dev/kmsg reader on the device's real semantics: one record per read, EINVAL on a short
buffer, EAGAIN at the end, EPIPE on overwrite; and no replay across restarts."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from agent.contracts.collector import MemoryKeyValueStore
from agent.runtime.state import StateStore
from collectors.kernel_log.kmsg import (
    KMSG_CURSOR_KEY,
    STATE_NAMESPACE,
    FileLogReader,
    KernelLogError,
    KmsgReader,
    OsKmsgIO,
)
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
        batches = [reader.read() for _ in range(4)]
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
        assert len(reader.read().records) == 5
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
