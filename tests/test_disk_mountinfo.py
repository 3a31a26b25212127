"""mountinfo parsing: the kernel's octal escapes, optional fields, and this machine's real file."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from collectors._procfs import ProcParseError, parse_mountinfo, parse_mountinfo_line, unescape


def kernel_escape(path: str) -> str:
    """What the kernel's seq_escape does to a path in mountinfo: space, tab, newline, backslash."""
    return "".join(f"\\{ord(c):03o}" if c in " \t\n\\" else c for c in path)


paths = st.text(
    alphabet=st.characters(codec="utf-8", exclude_categories=["Cs"], exclude_characters="\x00"),
    min_size=1,
    max_size=40,
).map(lambda text: "/" + text)
optional_fields = st.lists(
    st.sampled_from(["shared:1", "master:7", "propagate_from:3", "unbindable"]), max_size=3
)


class TestMountinfoProperties:
    """Any path the kernel can write comes back unchanged; malformed lines raise ProcParseError."""

    @given(mount_point=paths, root=paths, source=paths, optional=optional_fields)
    def test_escaped_paths_round_trip(
        self, mount_point: str, root: str, source: str, optional: list[str]
    ) -> None:
        line = " ".join(
            [
                "36",
                "27",
                "8:17",
                kernel_escape(root),
                kernel_escape(mount_point),
                "rw,relatime",
                *optional,
                "-",
                "ext4",
                kernel_escape(source),
                "ro,errors=remount-ro",
            ]
        )
        (mount,) = parse_mountinfo(f"{line}\n")
        assert mount.mount_point == mount_point
        assert mount.root == root
        assert mount.source == source
        assert mount.fs_type == "ext4"
        assert mount.read_only

    @given(st.text(max_size=200))
    def test_arbitrary_text_parses_or_raises_the_parse_error(self, text: str) -> None:
        try:
            mounts = parse_mountinfo(text)
        except ProcParseError:
            return
        assert len(mounts) <= text.count("\n") + 1
        assert all(f" {m.major_minor} " in text for m in mounts)

    def test_space_escape_from_a_real_line(self) -> None:
        (mount,) = parse_mountinfo(
            "31 27 259:4 / /mnt/scratch\\040space rw - ext4 /dev/nvme2n1 rw\n"
        )
        assert mount.mount_point == "/mnt/scratch space"
        assert not mount.read_only

    def test_non_utf8_bytes_survive_for_statvfs(self) -> None:
        assert unescape("/mnt/caf\\351").encode("utf-8", "surrogateescape") == b"/mnt/caf\xe9"

    def test_a_line_without_separator_is_an_error(self) -> None:
        with pytest.raises(ProcParseError, match="separator"):
            parse_mountinfo_line("36 27 8:17 / /mnt rw,relatime ext4 /dev/sdb1 rw")

    def test_this_machines_mountinfo_parses(self) -> None:
        mounts = parse_mountinfo(Path("/proc/self/mountinfo").read_text(errors="surrogateescape"))
        assert any(m.mount_point == "/" for m in mounts)
