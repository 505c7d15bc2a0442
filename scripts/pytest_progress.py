"""pytest plugin used by scripts/test.sh: a line for each test file once its last test has finished,
with the share of the suite done and the time so far:

    tests/test_rope.py: 65 passed  [ 42% of 821 tests, 2:31]

Under pytest-xdist the tests of one file run on several workers in any order, so pytest's own
progress is a row of dots; these lines say where the suite is. Loaded with
`-p scripts.pytest_progress` from the repository root; it says nothing without xdist (pytest's
own lines are per file then) and does nothing in xdist's workers."""

from __future__ import annotations

import collections
import time

import pytest


def _file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


class FileProgress:
    def __init__(self, config: pytest.Config):
        self.config = config
        self.started = time.monotonic()
        self.per_file: dict[str, int] = {}
        self.total = 0
        self.finished = 0
        self.outcome: dict[str, str] = {}  # nodeid -> worst outcome of its phases so far
        self.counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)

    def _expect(self, nodeids) -> None:
        if self.per_file:
            return  # every xdist worker collects the same tests: the first one tells
        self.per_file = dict(collections.Counter(_file_of(n) for n in nodeids))
        self.total = sum(self.per_file.values())

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_node_collection_finished(self, node, ids) -> None:
        self._expect(ids)

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        if not hasattr(self.config, "workerinput"):
            self._expect(item.nodeid for item in session.items)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        seen = self.outcome.get(report.nodeid, "passed")
        if report.failed and seen not in ("failed", "error"):  # the first failure names it
            seen = "failed" if report.when == "call" else "error"
        elif report.skipped and seen == "passed":
            seen = "xfailed" if hasattr(report, "wasxfail") else "skipped"
        self.outcome[report.nodeid] = seen
        if report.when != "teardown":
            return
        path = _file_of(report.nodeid)
        self.counts[path][self.outcome.pop(report.nodeid)] += 1
        self.finished += 1
        if self.per_file and sum(self.counts[path].values()) == self.per_file.get(path):
            self._say(path)

    def _say(self, path: str) -> None:
        reporter = self.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is None or not self.config.pluginmanager.has_plugin("dsession"):
            return  # without xdist pytest prints a line per file itself
        order = ("passed", "failed", "error", "skipped", "xfailed")
        what = ", ".join(f"{self.counts[path][k]} {k}" for k in order if self.counts[path][k])
        minutes, seconds = divmod(int(time.monotonic() - self.started), 60)
        share = 100 * self.finished // max(self.total, 1)
        writer = getattr(reporter, "_tw", None)
        if writer is not None and getattr(writer, "width_of_current_line", 0):
            reporter.write("\n")  # end the row of dots first
        reporter.write_line(f"{path}: {what}  [{share:3d}% of {self.total} tests, {minutes}:{seconds:02d}]")


def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):
        config.pluginmanager.register(FileProgress(config), "file-progress")
