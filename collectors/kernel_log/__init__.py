"""The kernel log: /dev/kmsg or a followed file, parsed into findings (Xid, SXid, I/O, OOM...)."""
