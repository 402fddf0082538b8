"""The settings that are vLLM engine arguments too (dtype, enforce_eager, ...) are checked
against vLLM's own field types, which llmpipe/engines/vllm_args.py keeps (ALIAS_TYPES), so
that `llmpipe up` checks them without importing vLLM."""

from __future__ import annotations

import subprocess
import sys

import pytest

from llmpipe.engines.platform import check_engine_args
from llmpipe.engines.vllm_args import ALIAS_TYPES, EngineArgError, vllm_engine_fields
from llmpipe.settings import Settings


def test_the_settings_that_are_engine_arguments_have_vllms_own_types():
    fields = vllm_engine_fields()  # vLLM's AsyncEngineArgs
    assert {name: fields[name] for name in ALIAS_TYPES} == ALIAS_TYPES


def test_checking_the_settings_imports_no_vllm():
    code = ("import sys; from llmpipe.engines.platform import check_engine_args; from llmpipe.settings import Settings; "
            "check_engine_args(Settings(dtype='float32', enforce_eager=True, max_num_seqs=8, max_model_len=512)); "
            "print(sorted(m for m in ('vllm', 'torch') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "[]"


@pytest.mark.parametrize(("given", "message"), [
    ({"dtype": "float64"}, "engine argument dtype='float64': Input should be 'auto', 'half', 'float16', 'bfloat16', "
                           "'float' or 'float32'"),
    ({"engine_args": {"tensor_paralel_size": "2"}}, "unknown vLLM engine argument 'tensor_paralel_size'"),
])
def test_a_bad_setting_or_engine_argument_still_names_the_field(given, message):
    with pytest.raises(EngineArgError) as e:
        check_engine_args(Settings(engine="vllm", **given))
    assert message in str(e.value)
