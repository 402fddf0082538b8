import logging

from llmpipe.messages import ErrorReason, FinishReason, Generation, Stage, StageError, StageTiming
from llmpipe.processors.output_processor import OutputProcessor


def _gen(tok, **kw):
    ids = tok("Paris is lovely")["input_ids"]
    base = dict(
        job_id="j9", index=2, deadline=2000.0, enqueued_at=1000.5, prompt_tokens=5, output_token_ids=ids,
        finish_reason=FinishReason.LENGTH, batch_size=4, engine_time_s=0.3,
        timings=[StageTiming(stage=Stage.PREPROCESS, enqueued_at=999.0, started_at=999.1, finished_at=999.2),
                 StageTiming(stage=Stage.INFERENCE, enqueued_at=999.2, started_at=999.25, finished_at=1000.5)],
    )
    base.update(kw)
    return Generation(**base)


def test_detokenizes_and_reports_per_stage_timings(tiny_tokenizer, caplog):
    proc = OutputProcessor(tiny_tokenizer, clock=lambda: 1001.0)
    # Per prompt at DEBUG (the job's one INFO line is the collector's: test_collector.py).
    with caplog.at_level(logging.DEBUG, logger="llmpipe.postprocess"):
        res = proc.process(_gen(tiny_tokenizer))
    assert res.text == "Paris is lovely"
    assert res.index == 2 and res.completion_tokens == len(res.token_ids) and res.prompt_tokens == 5
    assert res.finish_reason == FinishReason.LENGTH
    assert set(res.timings) == {Stage.PREPROCESS, Stage.INFERENCE, Stage.POSTPROCESS}
    assert abs(res.timings[Stage.INFERENCE].queue_wait_s - 0.05) < 1e-6
    assert abs(res.timings[Stage.POSTPROCESS].queue_wait_s - 0.5) < 1e-6
    line = caplog.records[-1].getMessage()
    assert "job=j9" in line and "stage=postprocess" in line and "elapsed_s=2.0000" in line


def test_failed_generation_keeps_its_error(tiny_tokenizer):
    err = StageError(reason=ErrorReason.ENGINE_ERROR, message="boom", stage=Stage.INFERENCE)
    res = OutputProcessor(tiny_tokenizer, clock=lambda: 1001.0).process(_gen(tiny_tokenizer, error=err, output_token_ids=[]))
    assert res.error == err and res.text == "" and res.finish_reason == FinishReason.ERROR


def test_expired_maps_to_expired_finish(tiny_tokenizer):
    res = OutputProcessor(tiny_tokenizer, clock=lambda: 3000.0).process(_gen(tiny_tokenizer))
    assert res.error.reason == ErrorReason.EXPIRED and res.finish_reason == FinishReason.EXPIRED


def test_stop_strings_cut_the_text_and_finish_with_stop(tiny_tokenizer):
    res = OutputProcessor(tiny_tokenizer, clock=lambda: 1001.0).process(_gen(tiny_tokenizer, stop=["is", "zzz"]))
    assert res.text == "Par" and res.finish_reason == FinishReason.STOP  # "Par|is" holds the first stop


def test_apply_stop_strings_picks_the_earliest():
    from llmpipe.processors.output_processor import apply_stop_strings

    assert apply_stop_strings("abc def ghi", ["ghi", "def"]) == ("abc ", True)
    assert apply_stop_strings("abc", ["x", ""]) == ("abc", False)


def test_echo_and_logprobs_come_back_with_token_texts(tiny_tokenizer):
    from llmpipe.messages import Logprob

    out_ids = tiny_tokenizer("Paris is lovely")["input_ids"]
    prompt_ids = tiny_tokenizer("<|im_start|>hello", split_special_tokens=False)["input_ids"]
    gen = _gen(tiny_tokenizer, output_token_ids=out_ids, prompt_token_ids=prompt_ids, prompt_tail=prompt_ids[-8:],
               logprobs=[[Logprob(id=t, logprob=-1.5, rank=1)] for t in out_ids],
               prompt_logprobs=[[Logprob(id=prompt_ids[0])]] + [[Logprob(id=t, logprob=-2.0, rank=3)] for t in prompt_ids[1:]])
    res = OutputProcessor(tiny_tokenizer, clock=lambda: 1001.0).process(gen)
    assert res.prompt_text == tiny_tokenizer.decode(prompt_ids)  # special tokens kept, as vLLM's echo
    assert res.prompt_token_ids == prompt_ids
    assert "".join(p[0].token for p in res.logprobs) == res.text
    assert res.prompt_logprobs[0][0].token == "<|im_start|>" and res.prompt_logprobs[0][0].logprob is None


def test_stop_string_cuts_the_ids_and_logprobs_and_is_the_stop_reason(tiny_tokenizer):
    from llmpipe.messages import Logprob

    ids = tiny_tokenizer("abc def ghi jkl")["input_ids"]
    gen = _gen(tiny_tokenizer, output_token_ids=ids, stop=[" def"],
               logprobs=[[Logprob(id=t, logprob=-1.0, rank=1)] for t in ids])
    res = OutputProcessor(tiny_tokenizer, clock=lambda: 1001.0).process(gen)
    assert res.text == "abc" and res.stop_reason == " def" and res.finish_reason == FinishReason.STOP
    assert res.completion_tokens == len(res.token_ids) == len(res.logprobs) < len(ids)


def test_a_stop_token_is_the_stop_reason_and_not_text(tiny_tokenizer):
    ids = tiny_tokenizer("Paris is")["input_ids"]
    res = OutputProcessor(tiny_tokenizer, clock=lambda: 1001.0).process(
        _gen(tiny_tokenizer, output_token_ids=ids, finish_reason=FinishReason.STOP, stop_token=ids[-1]))
    assert res.token_ids == ids and res.stop_reason == ids[-1]
    assert res.text == tiny_tokenizer.decode(ids[:-1])
