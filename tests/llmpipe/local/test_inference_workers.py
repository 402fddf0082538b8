"""Several inference workers per model in ``llmpipe up``: the setting, the children's names,
and each worker's GPUs (llmpipe/local/devices.py), without starting anything."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from llmpipe.engines.platform import Platform, engine_config
from llmpipe.local.devices import DeviceError, assign, gpus_per_worker
from llmpipe.local.pipeline import inference_children
from llmpipe.settings import Settings

FIELDS = {"tensor_parallel_size": int, "pipeline_parallel_size": int, "data_parallel_size": int}


def test_the_setting_takes_a_number_for_every_model_or_one_per_name():
    assert Settings(model="tiny", inference_workers=3).workers_of("tiny") == 3
    s = Settings(models=["a=tiny", "b=tiny"], inference_workers="a=2")
    assert (s.workers_of("a"), s.workers_of("b")) == (2, 1)
    assert Settings(models=["a=tiny", "b=tiny"], inference_workers='{"b": 4}').workers_of("b") == 4
    with pytest.raises(ValueError, match="not a served model"):
        Settings(model="tiny", inference_workers={"nope": 2})
    with pytest.raises(ValueError, match="at least 1"):
        Settings(model="tiny", inference_workers=0)


def test_each_worker_of_a_model_is_a_child_of_its_own():
    assert inference_children(Settings(model="tiny")) == [("inference", None)]
    assert inference_children(Settings(model="tiny", inference_workers=2)) == [("inference-1", None),
                                                                               ("inference-2", None)]
    several = Settings(models=["a=tiny", "b=tiny"], inference_workers="a=2")
    assert inference_children(several) == [("inference.a-1", "a"), ("inference.a-2", "a"), ("inference.b", "b")]


def test_on_cuda_each_worker_gets_gpus_of_its_own_in_order():
    s = Settings(model="tiny", inference_workers=2, engine_args={"tensor_parallel_size": 2})
    assert gpus_per_worker(s) == 2
    assert assign(s, ["inference-1", "inference-2"], ["0", "1", "2", "3"]) == {"inference-1": "0,1",
                                                                               "inference-2": "2,3"}
    # CUDA_VISIBLE_DEVICES given to llmpipe up: its GPUs, by the names it gives them
    assert assign(s, ["inference-1", "inference-2"], ["GPU-a", "GPU-b", "GPU-c", "GPU-d", "GPU-e"]) == {
        "inference-1": "GPU-a,GPU-b", "inference-2": "GPU-c,GPU-d"}


def test_workers_that_do_not_fit_the_gpus_stop_the_start_and_say_why():
    s = Settings(model="tiny", inference_workers=3, engine_args={"tensor_parallel_size": 2})
    with pytest.raises(DeviceError) as e:
        assign(s, ["inference-1", "inference-2", "inference-3"], ["0", "1", "2", "3"])
    assert str(e.value).startswith("3 inference workers x 2 GPUs each (tensor_parallel_size x pipeline_parallel_size "
                                   "x data_parallel_size) need 6 GPUs, and 4 are visible (0,1,2,3)")


def test_on_the_cpu_or_with_one_worker_per_model_the_workers_share():
    assert assign(Settings(model="tiny", inference_workers=2), ["inference-1", "inference-2"], []) == {}
    assert assign(Settings(models=["a=tiny", "b=tiny"]), ["inference.a", "inference.b"], ["0"]) == {}


def test_models_on_gpus_of_their_own_each_keep_vllms_memory_share():
    shared = engine_config(Settings(models=["a=tiny", "b=tiny"]), Platform.CUDA, vllm_fields=FIELDS)
    own = engine_config(Settings(models=["a=tiny", "b=tiny"], inference_workers="a=2"), Platform.CUDA,
                        vllm_fields=FIELDS)
    assert shared.args["gpu_memory_utilization"] == 0.45 and own.args["gpu_memory_utilization"] == 0.9


def test_llmpipe_up_takes_the_flag_as_the_setting(tmp_path):
    from llmpipe.cli.commands import main

    res = CliRunner().invoke(main, ["up", "--model", "tiny", "--inference-workers", "2", "--state-dir", str(tmp_path),
                                    "--print-config"])
    assert res.exit_code == 0 and "inference_workers = 2" in res.output
    res = CliRunner().invoke(main, ["up", "--model", "a=tiny", "--model", "b=tiny", "--inference-workers", "a=2",
                                    "--inference-workers", "b=3", "--state-dir", str(tmp_path), "--print-config"])
    assert res.exit_code == 0 and 'inference_workers = {"a": 2, "b": 3}' in res.output
    res = CliRunner().invoke(main, ["up", "--model", "tiny", "--inference-workers", "2", "--inference-workers", "x=1",
                                    "--print-config"])
    assert res.exit_code != 0 and "one N for every model, or NAME=N per model" in res.output
