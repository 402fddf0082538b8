"""The served-model registry (llmpipe/models/served.py): names, queues, routing; no Celery."""

from __future__ import annotations

import pytest

from llmpipe.errors import ModelNotFoundError
from llmpipe.jobs.admission import stage_queues
from llmpipe.messages import ErrorReason
from llmpipe.models.served import ModelSet, ModelSpecError, model_of_queue, parse_spec, stage_of
from llmpipe.settings import Settings
from workers.launch import queues_of, worker_argv
from workers.pool_policy import Started, plan


def test_one_model_keeps_the_inference_queue_and_its_setting_as_id():
    served = ModelSet.from_specs(["/models/SmolLM2-135M/"])
    m = served.default
    assert (m.name, m.queue, m.id) == ("SmolLM2-135M", "inference", "/models/SmolLM2-135M/")
    assert not served.several
    assert served.stage_queues() == ("preprocess", "inference", "postprocess")
    assert served.readiness_stages() == ("preprocess", "inference", "postprocess", "collect")


def test_several_models_each_get_their_own_queue_and_the_first_is_the_default():
    served = ModelSet.from_specs(["smollm2", "t2=/cache/tiny-seed1"])
    assert [(m.name, m.source, m.queue, m.id) for m in served.models] == [
        ("smollm2", "smollm2", "inference.smollm2", "smollm2"),
        ("t2", "/cache/tiny-seed1", "inference.t2", "t2"),
    ]
    assert served.default.name == "smollm2"
    assert served.stage_queues() == ("preprocess", "inference.smollm2", "inference.t2", "postprocess")
    assert served.readiness_stages()[1:3] == ("inference.smollm2", "inference.t2")


@pytest.mark.parametrize("requested, name", [
    (None, "smollm2"), ("", "smollm2"), ("smollm2", "smollm2"), ("t2", "t2"),
    ("/cache/tiny-seed1", "t2"), ("/cache/tiny-seed1/", "t2"), ("org/tiny-seed1", "t2"),
])
def test_a_request_names_a_model_by_name_source_or_last_segment(requested, name):
    assert ModelSet.from_specs(["smollm2", "t2=/cache/tiny-seed1"]).get(requested).name == name


def test_an_exact_name_wins_over_another_models_folder():
    served = ModelSet.from_specs(["a=/x/tiny", "tiny"])
    assert served.get("tiny").name == "tiny"


def test_a_model_not_served_is_model_not_found_naming_the_served_ones():
    with pytest.raises(ModelNotFoundError) as e:
        ModelSet.from_specs(["smollm2", "tiny"]).get("gpt-4")
    assert e.value.reason is ErrorReason.MODEL_NOT_FOUND and e.value.param == "model"
    assert "gpt-4" in e.value.message and "'smollm2', 'tiny'" in e.value.message


@pytest.mark.parametrize("specs, fragment", [
    ([], "no model"), (["tiny", "tiny"], "given twice"), (["bad name=tiny"], "letters, digits"),
    (["x="], "names no source"), ([" "], "empty"),
])
def test_bad_model_lists_are_refused(specs, fragment):
    with pytest.raises(ModelSpecError, match=fragment):
        ModelSet.from_specs(specs)


def test_parse_spec_and_queue_helpers():
    assert parse_spec("HuggingFaceTB/SmolLM2-135M-Instruct") == ("SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct")
    assert parse_spec("big = org/model") == ("big", "org/model")
    assert (stage_of("inference.tiny"), stage_of("inference"), stage_of("preprocess")) == ("inference", "inference", "preprocess")
    assert (model_of_queue("inference.tiny"), model_of_queue("inference")) == ("tiny", None)
    served = ModelSet.from_specs(["smollm2", "tiny"])
    assert served.for_queue("inference.tiny").name == "tiny"
    assert ModelSet.from_specs(["tiny"]).for_queue("inference").name == "tiny"


def test_settings_take_models_from_a_comma_list_or_json_and_keep_model_the_default(monkeypatch):
    monkeypatch.setenv("LLMPIPE_MODELS", "smollm2, t2=/cache/tiny-seed1")
    s = Settings()
    assert s.served.names == ["smollm2", "t2"] and s.model == "smollm2"
    monkeypatch.setenv("LLMPIPE_MODELS", '["tiny", "smollm2"]')
    assert Settings().model == "tiny"
    monkeypatch.delenv("LLMPIPE_MODELS")
    assert Settings(model="tiny").served.inference_queues == ("inference",)
    with pytest.raises(ValueError, match="given twice"):
        Settings(models=["tiny", "tiny"])


def test_admission_counts_the_jobs_own_model_queue():
    assert stage_queues("inference.tiny") == ("preprocess", "inference.tiny", "postprocess")


def test_one_inference_worker_per_model_and_cpu_workers_for_all():
    s = Settings(models=["smollm2", "tiny"])
    assert queues_of("inference", s, "tiny") == ("inference.tiny",)
    assert queues_of("inference", s) == ("inference.smollm2",)
    assert queues_of("preprocess", s) == ("preprocess",)
    argv = worker_argv("inference", s, model="tiny")
    assert argv[argv.index("-Q") + 1] == "inference.tiny" and argv[argv.index("-n") + 1] == "inference.tiny@%h"
    with pytest.raises(ModelNotFoundError):
        queues_of("inference", s, "gpt-4")
    single = Settings(model="tiny")
    argv = worker_argv("inference", single)
    assert argv[argv.index("-Q") + 1] == "inference" and argv[argv.index("-n") + 1] == "inference@%h"


def _started(queues, **kw) -> Started:
    base = dict(pool="prefork", pool_given=False, concurrency=2, concurrency_given=False, prefetch_given=False,
                name_given=False)
    return Started(queues=tuple(queues), **{**base, **kw})


def test_a_plain_celery_worker_on_a_model_queue_serves_that_model_on_threads():
    s = Settings(models=["smollm2", "tiny"])
    p = plan(_started(["inference.tiny"]), s, "host")
    assert (p.kind, p.stages, p.pool, p.model, p.node, p.refusal) == (
        "inference", {"inference"}, "threads", "tiny", "inference.tiny@host", None)


def test_one_worker_for_two_models_queues_is_refused():
    s = Settings(models=["smollm2", "tiny"])
    p = plan(_started(["inference.smollm2", "inference.tiny"]), s, "host")
    assert p.refusal is not None and "one model's inference queue" in p.refusal


def test_a_single_model_worker_is_planned_as_before():
    p = plan(_started(["inference"]), Settings(model="tiny"), "host")
    assert (p.kind, p.model, p.node, p.pool) == ("inference", "tiny", "inference@host", "threads")


def test_up_takes_several_models_from_repeated_flags(monkeypatch):
    from click.testing import CliRunner

    from llmpipe import cli

    seen = {}
    monkeypatch.setattr("llmpipe.local.up.run_up", lambda s, **kw: seen.setdefault("s", s) and 0)
    result = CliRunner().invoke(cli.main, ["up", "--model", "smollm2", "--model", "t2=/cache/tiny-seed1"])
    assert result.exit_code == 0, result.output
    assert seen["s"].served.names == ["smollm2", "t2"] and seen["s"].model == "smollm2"
    bad = CliRunner().invoke(cli.main, ["up", "--model", "tiny", "--model", "tiny"])
    assert bad.exit_code != 0 and "given twice" in bad.output


def test_worker_inference_model_flag_prints_its_queue(monkeypatch):
    from click.testing import CliRunner

    from llmpipe import cli

    monkeypatch.setenv("LLMPIPE_MODELS", "smollm2,tiny")
    out = CliRunner().invoke(cli.main, ["worker", "inference", "--model", "tiny", "--print"])
    assert out.exit_code == 0 and "-Q inference.tiny" in out.output and "-n inference.tiny@%h" in out.output
    bad = CliRunner().invoke(cli.main, ["worker", "inference", "--model", "gpt-4", "--print"])
    assert bad.exit_code != 0 and "gpt-4" in bad.output
