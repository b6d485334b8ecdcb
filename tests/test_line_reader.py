"""LineReader: lines written together are read one by one without waiting; a line not ended, or a pipe that
ended, times out or ends the read instead of blocking."""

from __future__ import annotations

import os
import time

from detached_rl.core.line_reader import LineReader


def test_two_lines_written_at_once_are_both_read_without_waiting() -> None:
    read, write = os.pipe()
    try:
        os.write(write, b'warning: something\n{"ok": 1}\n')
        reader = LineReader(read)
        assert reader.readline(5) == "warning: something\n"
        started = time.monotonic()
        assert reader.readline(5) == '{"ok": 1}\n'  # already read: no wait on the descriptor
        assert time.monotonic() - started < 1
    finally:
        os.close(read)
        os.close(write)


def test_a_line_not_ended_times_out_and_is_read_once_ended() -> None:
    read, write = os.pipe()
    try:
        reader = LineReader(read)
        os.write(write, b"half")
        assert reader.readline(0.2) is None
        os.write(write, " a line é\n".encode())
        assert reader.readline(5) == "half a line é\n"
    finally:
        os.close(read)
        os.close(write)


def test_a_closed_pipe_ends_the_read() -> None:
    read, write = os.pipe()
    os.write(write, b"last\nunended")
    os.close(write)
    try:
        reader = LineReader(read)
        assert reader.readline(5) == "last\n"
        assert reader.readline(5) is None and reader.at_end
    finally:
        os.close(read)
