"""tests/cpu_report.py: the per-test CPU lines of `SIMLOOP_TEST_CPU` summed by test file."""

import pytest

from tests.cpu_report import by_file, by_worker, cpu_seconds


def test_lines_sum_by_file_most_cpu_first(tmp_path):
    path = tmp_path / "cpu.tsv"
    path.write_text(
        "tests/a.py::t1\t1.0\t2.0\t3.0\n"
        "tests/b.py::t\t0.5\t0.0\t1.0\n"
        "tests/a.py::t2[x::y]\t0.25\t0.25\t1.0\n"
    )
    assert by_file(path) == [("tests/a.py", 3.5, 4.0, 2), ("tests/b.py", 0.5, 1.0, 1)]


def test_workers_busy_time_span_and_idle_tail(tmp_path):
    path = tmp_path / "cpu.tsv"
    path.write_text(
        "tests/a.py::t1\t1.0\t2.0\t3.0\tgw0\t103.0\n"  # gw0: 100-103, then 104-110
        "tests/b.py::t\t0.5\t0.0\t4.0\tgw1\t105.0\n"  # gw1: 101-105
        "tests/a.py::t2\t0.25\t0.25\t6.0\tgw0\t110.0\n"
    )
    assert by_file(path) == [("tests/a.py", 3.5, 9.0, 2), ("tests/b.py", 0.5, 4.0, 1)]
    assert by_worker(path) == {"gw0": (9.0, 10.0, 0.0), "gw1": (4.0, 4.0, 5.0)}


def test_a_malformed_line_is_named(tmp_path):
    path = tmp_path / "cpu.tsv"
    path.write_text("tests/a.py::t\t1.0\t2.0\t3.0\ngarbage\n")
    with pytest.raises(
        ValueError, match=r"cpu.tsv:2: expected 6 \(or 4\) tab-separated fields, got 1"
    ):
        by_file(path)


def test_cpu_seconds_grow_with_work():
    own0, children0 = cpu_seconds()
    sum(i * i for i in range(2_000_000))
    own1, children1 = cpu_seconds()
    assert own1 > own0 and children1 >= children0
