"""/proc/[pid]/stat parsing: names with spaces and parentheses, and this machine's real file."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from collectors._procfs import ProcParseError, parse_stat
from tests.support.host import stat_line

# comm is at most 15 bytes and may hold anything but NUL; "(", ")" and spaces are the traps.
comms = st.text(alphabet=st.sampled_from("ab )(x-:/ .\t0"), max_size=15)


class TestStatProperties:
    """The fields after comm are found whatever comm holds."""

    @given(
        pid=st.integers(1, 4_194_304),
        comm=comms,
        state=st.sampled_from("RSDZTtXIPWK"),
        ppid=st.integers(0, 4_194_304),
        starttime=st.integers(0, 2**63),
        threads=st.integers(1, 100_000),
    )
    def test_round_trip(
        self, pid: int, comm: str, state: str, ppid: int, starttime: int, *, threads: int
    ) -> None:
        stat = parse_stat(stat_line(pid, comm, state, ppid, starttime, num_threads=threads))
        assert (stat.pid, stat.comm, stat.state, stat.ppid, stat.starttime, stat.num_threads) == (
            pid,
            comm,
            state,
            ppid,
            starttime,
            threads,
        )

    @given(st.text(max_size=300))
    def test_arbitrary_text_parses_or_raises_the_parse_error(self, text: str) -> None:
        try:
            stat = parse_stat(text)
        except ProcParseError:
            return
        assert f"({stat.comm})" in text
        assert stat.state == text[text.rfind(")") + 1 :].split(maxsplit=1)[0]

    def test_truncated_line_is_an_error(self) -> None:
        with pytest.raises(ProcParseError, match="fields"):
            parse_stat("12 (bash) S 1 12 12")

    def test_this_process(self) -> None:
        stat = parse_stat(Path(f"/proc/{os.getpid()}/stat").read_text())
        assert stat.pid == os.getpid()
        assert stat.ppid == os.getppid()
        assert stat.state in "RS"
