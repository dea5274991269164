"""Where a hang report says a rank is stuck: its innermost frame outside the standard
library, from the host's own stack dump or from py-spy's."""

from __future__ import annotations

import sys
import threading
import traceback

import pytest
import torch

from phalanx.group.hang import HangReport
from tests.helpers import until

pytestmark = pytest.mark.timeout(30)


def _report(stack: str) -> HangReport:
    return HangReport("g", "block", 1.0, [0], stacks={0: stack})


def test_a_rank_waiting_inside_the_standard_library_is_placed_in_its_own_code():
    release = threading.Event()

    def wait_for_release() -> None:
        release.wait(20)  # threading.py frames are innermost while it waits

    def _px_call() -> None:
        wait_for_release()

    t = threading.Thread(target=_px_call, name="call")
    t.start()
    try:

        def frame():
            return sys._current_frames()[t.ident]

        assert until(lambda: frame().f_code.co_filename == threading.__file__, 10)
        stack = "--- thread call ---\n" + "".join(traceback.format_stack(frame()))
    finally:
        release.set()
        t.join(10)
    line = wait_for_release.__code__.co_firstlineno + 1
    assert 'threading.py", line' in stack.rsplit("\n  File ", 1)[1]
    assert _report(stack).innermost(0) == f"wait_for_release (test_hang_report.py:{line})"


def test_frozen_modules_are_passed_over_installed_packages_are_not():
    ours = (
        "--- thread MainThread ---\n"
        '  File "/srv/app/host.py", line 10, in _px_call\n'
        '  File "/srv/app/poll.py", line 7, in block\n'
        '  File "<frozen genericpath>", line 19, in exists\n'
    )
    assert _report(ours).innermost(0) == "block (poll.py:7)"
    library = (
        "--- thread MainThread ---\n"
        f'  File "{threading.__file__}", line 5, in _px_call\n'
        f'  File "{threading.__file__}", line 9, in wait\n'
    )
    assert _report(library).innermost(0) == "wait (threading.py:9)"
    installed = (  # an installed package's frame (torch) is not the standard library's
        "--- thread MainThread ---\n"
        '  File "/srv/app/host.py", line 10, in _px_call\n'
        f'  File "{torch.__file__}", line 3, in matmul\n'
        f'  File "{threading.__file__}", line 9, in wait\n'
    )
    assert _report(installed).innermost(0) == "matmul (__init__.py:3)"


def test_py_spy_stacks_are_read_innermost_first():
    stack = (
        '(py-spy)\nThread 12 (active): "MainThread"\n'
        "    exists (<frozen genericpath>:19)\n"
        "    block (/srv/app/poll.py:7)\n"
        "    _px_call (/srv/app/host.py:10)\n"
        '\nThread 13 (idle): "other"\n'
        "    run (/srv/app/other.py:3)\n"
    )
    assert _report(stack).innermost(0) == "block (poll.py:7)"
