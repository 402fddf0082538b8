"""The priority bench's figures (llmpipe/bench/priority.py) from samples: the ratio and the
verdict, which a starved batch job or a failed interactive one turns to missed."""

from llmpipe.bench.loadgen import Sample
from llmpipe.bench.priority import PriorityOptions, figures, markdown


def _samples(latencies, ok=True):
    return [Sample(i=i, start=0.0, latency_s=v, ok=ok) for i, v in enumerate(latencies)]


def test_the_ratio_is_of_the_p50s_and_meets_the_target_only_when_every_job_finished():
    batch, inter = _samples([10.0, 20.0, 30.0]), _samples([1.0, 2.0, 3.0])
    res = figures(batch, inter, 60.0)
    assert res["ratio_p50"] == 0.1 and res["met"]
    starved = figures(batch + [Sample(i=3, start=0.0, error="no complete answer within 900s")], inter, 60.0)
    assert starved["batch"]["ok"] == 3 and starved["batch"]["sent"] == 4 and not starved["met"]
    slow = figures(batch, _samples([4.0, 5.0]), 60.0)
    assert not slow["met"]
    assert "**0.10**" in markdown(res, PriorityOptions(), "conditions")


def test_the_engine_split_reads_each_lanes_slot_wait_and_run_from_the_simulated_engines_log():
    from llmpipe.bench.priority import engine_line, engine_split

    log = ("[INFO] simulated request=a-0 priority=10 engine_wait_s=1.500 engine_run_s=2.000\n"
           "noise\n[INFO] simulated request=b-0 priority=10 engine_wait_s=0.500 engine_run_s=1.000\n"
           "[INFO] simulated request=c-0 priority=0 engine_wait_s=0.000 engine_run_s=0.700\n")
    split = engine_split(log, batch_priority=10)
    assert split["batch"] == {"n": 2, "wait_s": 1.0, "run_s": 1.5}
    assert split["interactive"] == {"n": 1, "wait_s": 0.0, "run_s": 0.7}
    assert "interactive 0.00 / 0.70 (1 requests)" in engine_line(split)
    assert engine_split("", 10) == {}
