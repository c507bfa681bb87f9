"""The spool on a real filesystem: torn lines are quarantined, a failed append leaves no torn line."""

from __future__ import annotations

import resource
import signal
import subprocess
import sys
from pathlib import Path

import orjson

from proxy.record.spool import Spool


def _records(n: int, tag: str) -> list[dict]:
    return [{"id": f"{tag}-{i}", "body": "x" * 200} for i in range(n)]


def test_torn_lines_are_quarantined_not_skipped(tmp_path):
    spool = Spool(tmp_path / "spool")
    spool.append(_records(3, "a"))
    spool.close()
    (first,) = spool.segments()
    # A crash mid-append: half a record at the end of the segment, and a garbled line in the middle
    # of a second one (what a disk error can leave).
    with first.open("ab") as fh:
        fh.write(orjson.dumps({"id": "torn", "body": "y" * 100})[:40])
    spool.append(_records(2, "b"))
    spool.close()
    second = next(p for p in spool.segments() if p != first)
    second.write_bytes(second.read_bytes() + b'{"id": "b-x", "bo\n' + orjson.dumps({"id": "b-2"}) + b"\n")
    written: list[str] = []
    n = spool.drain(lambda recs: written.extend(r["id"] for r in recs))
    assert n == 6 and written == ["a-0", "a-1", "a-2", "b-0", "b-1", "b-2"]
    assert not spool.pending() and spool.quarantined == 2
    torn = sorted((spool.dir / "quarantine").glob("*.torn"))
    assert [p.stem for p in torn] == [first.stem, second.stem]
    assert torn[0].read_bytes().startswith(b'{"id":"torn"') and torn[1].read_bytes() == b'{"id": "b-x", "bo\n'


_CHILD = """
import sys
from pathlib import Path
from proxy.record.spool import Spool
spool = Spool(Path(sys.argv[1]))
spool.append([{"id": "fits", "body": "x" * 100}])
try:
    spool.append([{"id": "too-big", "body": "x" * 8000}])
except OSError as e:
    print("failed", e.errno)
spool.append([{"id": "after", "body": "x" * 100}])
"""


def _limit_file_size() -> None:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of death, as the writer child does
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))


def test_a_failed_append_leaves_no_torn_line(tmp_path):
    """A file-size limit (RLIMIT_FSIZE, as a full disk would) fails an append part-way: the spool cuts
    the segment back and raises; the next append starts a clean segment."""
    folder = tmp_path / "spool"
    out = subprocess.run([sys.executable, "-c", _CHILD, str(folder)], capture_output=True, text=True,
                         preexec_fn=_limit_file_size, cwd=Path(__file__).resolve().parents[2], timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[0] == "failed"
    spool = Spool(folder)
    lines = [ln for p in spool.segments() for ln in p.read_bytes().splitlines()]
    assert [orjson.loads(ln)["id"] for ln in lines] == ["fits", "after"]
    assert len(spool.segments()) == 2  # the failed append closed its segment


def test_purge_drops_only_the_selected_records_and_keeps_torn_lines(tmp_path):
    """A forget purges its session's pending records (#13); other records and a torn line stay for
    the drain (which replays and quarantines them)."""
    spool = Spool(tmp_path / "spool")
    rec = lambda sid, i: {"id": f"{sid}-{i}", "session": {"tenant_id": "t", "external_id": sid}}  # noqa: E731
    spool.append([rec("gone", 0), rec("kept", 0)])
    spool.append_segment([rec("gone", 1), rec("gone", 2)])
    spool._rotate()
    first = spool.segments()[0]
    first.write_bytes(first.read_bytes() + b'{"id": "torn", "sess')
    gone = spool.purge(lambda r: r["session"]["external_id"] == "gone")
    assert gone == 3
    assert len(spool.segments()) == 1  # the all-"gone" segment is deleted
    written: list[dict] = []
    spool.drain(written.extend)
    assert [r["id"] for r in written] == ["kept-0"]
    assert spool.quarantined == 1 and not list(spool.dir.glob("*.purge"))
