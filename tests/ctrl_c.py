"""Ctrl-C for a child process in a test, whatever the test run inherited.

A shell that starts a job in the background without job control (``cmd &`` in a script, ``nohup``) sets SIGINT to
"ignore" for it, and a child inherits that; Python then installs no KeyboardInterrupt handler, so a test that sends
SIGINT to its child would wait for nothing. ``restore_sigint`` (a ``preexec_fn``) gives the child the default
disposition back before it starts, so the child's interpreter handles Ctrl-C as it would in a terminal.
"""

from __future__ import annotations

import signal


def restore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)
