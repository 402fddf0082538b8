"""``llmpipe bench --modes multiworker`` (llmpipe/bench/multiworker.py): its workload, its
reading of /metrics and its report, and a smoke run of the tool on the tiny model (no speed
is asserted)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from llmpipe.bench.multiworker import MultiOptions, kv_tokens, markdown, parse_metrics, quick, workload

METRICS = """\
# TYPE llmpipe_engine_prefix_cache_queries_total counter
llmpipe_engine_prefix_cache_queries_total{model="tiny",worker="inference-1-9@llmpipe"} 1000.0
llmpipe_engine_prefix_cache_queries_total{model="tiny",worker="inference-2-9@llmpipe"} 500.0
# TYPE llmpipe_engine_prefix_cache_hits_total counter
llmpipe_engine_prefix_cache_hits_total{model="tiny",worker="inference-1-9@llmpipe"} 750.0
# TYPE llmpipe_route_requests_total counter
llmpipe_route_requests_total{match="prefix",model="tiny",outcome="routed"} 12.0
llmpipe_route_requests_total{match="none",model="tiny",outcome="spilled"} 1.0
"""


def test_the_prefix_cache_and_route_counts_are_read_per_worker():
    m = parse_metrics(METRICS)
    assert m["queries"] == {"inference-1-9@llmpipe": 1000.0, "inference-2-9@llmpipe": 500.0}
    assert m["hits"] == {"inference-1-9@llmpipe": 750.0}
    assert m["routes"] == {"routed/prefix": 12.0, "spilled/none": 1.0}


def test_every_prompt_is_one_of_the_shared_prefixes_and_a_question_of_its_own(tiny_tokenizer):
    o = MultiOptions(prefixes=3, prefix_tokens=64, question_tokens=8)
    prompts = workload(tiny_tokenizer, o, 30)
    heads = {p.split("\n\nQuestion: ")[0] for p in prompts}
    assert len(heads) == 3 and len(set(prompts)) == 30
    assert all(60 <= len(tiny_tokenizer(h)["input_ids"]) <= 66 for h in heads)


def test_the_kv_cache_is_counted_in_tokens_from_the_model_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 30, "num_key_value_heads": 3,
                                                      "num_attention_heads": 9, "hidden_size": 576, "head_dim": 64}))
    assert kv_tokens(str(tmp_path), 1.0) == (1 << 30) // (2 * 30 * 3 * 64 * 2)  # SmolLM2-135M in bf16: 46,603
    assert kv_tokens(str(tmp_path), 1.0, "auto") == kv_tokens(str(tmp_path), 1.0, "bfloat16") == 46603
    assert kv_tokens(str(tmp_path), 1.0, "float32") == 46603 // 2  # a CPU without bf16 keeps the cache in float32
    assert kv_tokens(str(tmp_path / "missing"), 1.0) is None


def test_the_report_states_both_figures_and_a_skipped_broker():
    point = {"condition": "prefix-aware routing", "summary": {"ttft_s": {"p50": 0.1, "p99": 0.4}, "output_tok_s": 50.0},
             "hit_rate": {"inference-1-9@llmpipe": 0.75, "inference-2-9@llmpipe": None}, "routes": {"routed/prefix": 12.0}}
    result = {"meta": {"machine": "m", "command": "c"}, "options": {**vars(MultiOptions()), "extra": {}},
              "routing": {"points": [point], "ratio_routed_to_shared": {"ttft_p50": 0.4}, "kv_cache_gib": 1.0,
                          "kv_cache_tokens": 46603, "prefix_set_tokens": 8192,
                          "goals": {"ttft_p50": "<= 0.5x", "output_tok_s": ">= 1.0x"}},
              "failover": [{"broker": "redis", "jobs": 40, "succeeded": 40, "held_at_kill": [20, 20],
                            "kill_to_last_done_s": 4.4, "control_last_done_s": 3.1, "added_by_failover_s": 1.3,
                            "goal_s": 6.0},
                           {"broker": "rabbitmq", "skipped": "ConnectionRefusedError"}]}
    md = markdown(result)
    assert "| prefix-aware routing | 100 | 400 | 50.0 | inference-1-9: 0.75, inference-2-9: no requests | routed/prefix: 12 |" in md
    assert "~46603 tokens: 5.7x the prefix set" in md and "on the shipped defaults" in md
    assert "| redis | 40 of 40 | [20, 20] | 4.40 (goal <= 6) | 3.10 | 1.30 |" in md and "skipped: ConnectionRefusedError" in md
    assert quick(MultiOptions()).brokers == ("redis",)


def test_the_quick_profile_takes_a_quarter_gib_kv_cache_unless_given_one():
    assert quick(MultiOptions()).kv_cache_gib == 0.25
    assert quick(MultiOptions(kv_cache_gib=2.0)).kv_cache_gib == 2.0


def test_the_quick_profile_states_its_settings_and_environment_in_both_figures():
    o = quick(MultiOptions())
    assert o.env == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    point = {"condition": "shared queue", "summary": {"output_tok_s": 1.0}, "hit_rate": {}, "routes": {}}
    result = {"meta": {}, "options": vars(o),
              "routing": {"points": [point], "ratio_routed_to_shared": {}, "kv_cache_gib": 1.0, "kv_cache_tokens": None,
                          "prefix_set_tokens": 512, "goals": {"ttft_p50": "-", "output_tok_s": "-"}},
              "failover": [{"broker": "rabbitmq", "skipped": "not asked"}]}
    md = markdown(result)
    said = "dtype=float32, enforce_eager=True, VLLM_ENABLE_V1_MULTIPROCESSING=0"
    assert f"GiB; on {said}." in md and f"`llmpipe up --inference-workers 2` on {said}," in md
    assert "shipped defaults" not in md


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_bench_multiworker_quick_runs_both_figures(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "llmpipe.cli", "bench", "--modes", "multiworker", "--quick",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=1440)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "multiworker" / "multiworker.json").read_text())
    assert [p["routing"] for p in result["routing"]["points"]] == [True, False]
    routed = result["routing"]["points"][0]
    assert routed["summary"]["ok"] == 8 and sum(routed["routes"].values()) == 8
    assert len(routed["hit_rate"]) == 2  # one per worker, also one that the routing gave nothing
    [f] = result["failover"]
    assert f["broker"] == "redis" and f["succeeded"] == f["jobs"] == 8
    assert f["settings"]["kv_cache_gib"] == result["routing"]["kv_cache_gib"] == 0.25  # both figures' stacks
    assert abs(f["added_by_failover_s"] - (f["kill_to_last_done_s"] - f["control_last_done_s"])) <= 0.011
    # The failover's `llmpipe up` serves the model folder the routing figure used: its own state
    # dir builds no second copy.
    assert not (tmp_path / "multiworker" / "failover-redis" / "models").exists()
    assert (tmp_path / "multiworker" / "multiworker.md").read_text().startswith("# Several inference workers")
