"""Disk space, inodes, read-only and stuck mounts, per mount point."""
