"""python -m benchmarks.suite_cpu: reading process accounting's records and charging each
process's CPU to the test its pytest-xdist worker ran when the process started."""

import calendar
import time

from benchmarks.suite_cpu import (EARLY, OUTSIDE, WORKERS, Exit, Sample, Sampler, attribute, markdown, module_of,
                                  parse_dump, report)

T0 = calendar.timegm(time.strptime("Mon Dec  7 07:28:05 2026", "%a %b %d %H:%M:%S %Y"))


def test_a_dump_acct_line_gives_the_command_its_cpu_in_seconds_and_its_start():
    text = ("VLLM::EngineCor |v3|  1520.00|    92.00|  3100.00|     0|     0| 15336.00|     0.00|    8147|    8142|"
            "     |       0|__      |Mon Dec  7 07:28:05 2026\nnot a record\n")
    [e] = parse_dump(text)
    assert e == Exit("VLLM::EngineCor", 16.12, 8147, 8142, float(T0), 31.0)
    assert e.ended == T0 + 31.0


def test_a_worker_title_names_the_module_of_its_test():
    assert module_of("[pytest-xdist running] tests/a/test_x.py::test_y[redis]") == "tests/a/test_x.py"
    assert module_of("python -m pytest -n 2") is None


def test_the_sampler_keeps_each_workers_test_and_the_parents_before_init_takes_them():
    tables = iter([({10: "[pytest-xdist running] tests/test_a.py::t", 11: "celery"}, {10: 5, 11: 10}),
                   ({10: "[pytest-xdist running] tests/test_b.py::t"}, {10: 5, 11: 1})])
    s = Sampler(read=lambda: next(tables))
    s.sample(100.0)
    s.sample(101.0)
    assert s.samples == [Sample(100.0, 10, "tests/test_a.py"), Sample(101.0, 10, "tests/test_b.py")]
    assert s.parents == {10: 5, 11: 10}  # 11's parent died: the one seen before stays


def _exit(comm, cpu, pid, ppid, start, elapsed=1.0):
    return Exit(comm, cpu, pid, ppid, T0 + start, elapsed)


def test_each_process_counts_for_the_test_its_worker_ran_when_it_started():
    samples = [Sample(T0 + t, 100, "tests/test_a.py") for t in (0, 10, 20)]
    samples += [Sample(T0 + t, 100, "tests/test_b.py") for t in (30, 40)]
    exits = [
        _exit("celery", 12.0, 200, 100, 5, elapsed=20),  # a stack of test_a's
        _exit("VLLM::EngineCor", 15.0, 300, 200, 6),  # its grandchild
        _exit("gloo", 3.0, 301, 1, 7),  # its parent died first: the sampled parent says whose
        _exit("celery", 2.0, 200, 100, 35),  # pid 200 again, now test_b's
        _exit("python", 1.0, 400, 300, 36),  # pid 300 is reused by nobody: no worker above
        _exit("dockerd", 9.0, 500, 50, 1),  # started by the run's controller
        _exit("[pytest-xdist i", 30.0, 100, 50, 0, elapsed=50),  # its title as it exits: idle
    ]
    table = attribute(exits, samples, parents={301: 300})
    assert table["tests/test_a.py"]["cpu_s"] == 30.0 and table["tests/test_a.py"]["processes"] == 3
    assert table["tests/test_a.py"]["heavy"] == 2  # over 8 CPU-s each
    assert table["tests/test_b.py"]["cpu_s"] == 2.0
    assert table[OUTSIDE]["cpu_s"] == 10.0  # dockerd, and the orphan whose ancestors are gone
    assert table[WORKERS]["cpu_s"] == 30.0


def test_a_process_long_before_its_workers_first_test_is_not_charged_to_that_test():
    table = attribute([_exit("python", 1.0, 200, 100, 0)], [Sample(T0 + 100, 100, "tests/test_a.py")], {})
    assert list(table) == [EARLY]


def test_the_report_states_the_total_and_the_floor_on_the_cores():
    samples = [Sample(T0, 100, "tests/test_a.py")]
    rep = report(attribute([_exit("celery", 30.0, 200, 100, 1), _exit("pip", 10.0, 500, 50, 1)], samples, {}),
                 wall_s=40.0, cores=2)
    assert rep["cpu_s"] == 40.0 and rep["floor_s"] == 20.0 and rep["busy"] == 0.5 and rep["heavy_processes"] == 2
    assert [r["module"] for r in rep["modules"]] == ["tests/test_a.py", OUTSIDE]
    md = markdown(rep)
    assert "40 CPU-s in all" in md and "20 s of wall" in md and "| tests/test_a.py | 30 | 1 | 1 | celery 30 |" in md
