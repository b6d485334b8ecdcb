"""Lines from a pipe under a deadline.

`select` is asked about the raw descriptor and the bytes are kept here: a buffered stream's `readline` after
`select` may pull two lines into its own buffer, and the next `select` then waits on a descriptor with nothing
more to say while the line it waits for sits read (a child that writes a warning and its answer at once).
"""

from __future__ import annotations

import os
import select
import time


class LineReader:
    """Newline-ended lines read from file descriptor `fd`; no other reader may read it."""

    def __init__(self, fd: int, encoding: str = "utf-8") -> None:
        self.fd, self.encoding = fd, encoding
        self._buffer = b""
        self.at_end = False  # the writer closed its end

    def readline(self, timeout_s: float) -> str | None:
        """The next line (with its newline), or None when none ends within `timeout_s` s or the pipe ended."""
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if self.at_end or left <= 0 or not select.select([self.fd], [], [], left)[0]:
                return None
            chunk = os.read(self.fd, 65536)
            if not chunk:
                self.at_end = True
                return None
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line.decode(self.encoding, "replace") + "\n"
