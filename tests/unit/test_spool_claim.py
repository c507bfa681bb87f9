"""A spool folder per live process (proxy.record.spool.claim_folder): replicas on one home volume
(`docker compose up --scale proxy=3`, each with worker index 0) must not share one, or one deletes a
segment another still appends to."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from proxy.config import spool_folder
from proxy.record.spool import claim_folder


def test_each_claim_gets_a_free_folder_and_a_released_one_is_taken_again(tmp_path):
    root = tmp_path / "spool"
    folder_of = lambda k: spool_folder(tmp_path, k)  # noqa: E731
    a, fd_a = claim_folder(folder_of, 0)
    b, fd_b = claim_folder(folder_of, 0)  # a second replica, also worker 0
    c, fd_c = claim_folder(folder_of, 2)  # worker 2 of `--workers`: its own index, now taken
    d, fd_d = claim_folder(folder_of, 2)
    assert (a, b, c, d) == (0, 1, 2, 3)
    assert (root / ".owner").exists() and (root / "worker-1").is_dir()
    os.close(fd_b)  # that replica is gone: its folder, and what it left there, go to the next
    assert claim_folder(folder_of, 0)[0] == 1
    for fd in (fd_a, fd_c, fd_d):
        os.close(fd)


def test_a_folder_held_by_another_process_is_skipped_until_it_exits(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys
            from pathlib import Path
            from proxy.config import spool_folder
            from proxy.record.spool import claim_folder
            print(claim_folder(lambda k: spool_folder(Path({str(tmp_path)!r}), k), 0)[0], flush=True)
            sys.stdin.read()
        """)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "0"
        k, fd = claim_folder(lambda k: spool_folder(tmp_path, k), 0)
        assert k == 1
        os.close(fd)
    finally:
        holder.stdin.close()
        holder.wait(10)
    k, fd = claim_folder(lambda k: spool_folder(tmp_path, k), 0)
    assert k == 0  # its holder exited: the lock went with it
    os.close(fd)
