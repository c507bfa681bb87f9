"""Ctrl-C stops the demo even when it lands in an at-fork hook (proxy.demo.run.interrupt).

Python runs a signal handler at its next instruction. When that instruction is in an at-fork hook
(logging releases its lock after every fork, and the demo forks for each process it starts), the
KeyboardInterrupt is reported as unraisable and dropped: a CI run's demo ignored its Ctrl-C and ran
on to its end. Here the signal is sent from inside such a hook, in a process of its own.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import os, signal, time
    from proxy.demo.run import INTERRUPT_CAUGHT, interrupt
    signal.signal(signal.SIGINT, {handler})

    def hook():  # the signal arrives while an at-fork hook runs, as in logging's lock release
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(1000):
            pass

    os.register_at_fork(after_in_parent=hook)
    try:
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
        time.sleep(4)  # the second raise comes after one
        print("ran on")
    except KeyboardInterrupt:
        INTERRUPT_CAUGHT.set()
        print("interrupted")
""")


def run(handler: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", SCRIPT.format(handler=handler)], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)


def test_an_interrupt_dropped_in_an_at_fork_hook_is_raised_again():
    plain = run("signal.default_int_handler")  # what the demo had: the interrupt is lost
    assert plain.stdout.strip() == "ran on" and "KeyboardInterrupt" in plain.stderr
    r = run("interrupt")
    assert r.stdout.strip() == "interrupted", r.stdout + r.stderr
