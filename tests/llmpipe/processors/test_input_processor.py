import pytest

from llmpipe.messages import ChatMessage, ErrorReason, PromptRequest, SamplingParams, Stage
from llmpipe.processors.input_processor import InputProcessor


class WallClock:
    def __init__(self, t=1000.0):
        self.t = t

    def __call__(self):
        return self.t


def _req(**kw):
    base = dict(job_id="j1", index=0, deadline=2000.0, enqueued_at=999.0, params=SamplingParams(max_tokens=8))
    base.update(kw)
    return PromptRequest(**base)


@pytest.fixture
def proc(tiny_tokenizer):
    return InputProcessor(tiny_tokenizer, context_len=64, clock=WallClock())


def test_prompt_is_tokenized_with_the_models_tokenizer(proc, tiny_tokenizer):
    out = proc.process(_req(prompt="The capital of France is"))
    assert out.error is None
    assert out.prompt_token_ids == tiny_tokenizer("The capital of France is")["input_ids"]
    assert out.params.max_tokens == 8
    assert [t.stage for t in out.timings] == [Stage.PREPROCESS]
    assert out.timings[0].queue_wait_s == pytest.approx(1.0)


def test_chat_template_is_applied(proc, tiny_tokenizer):
    msgs = [ChatMessage(role="system", content="Be brief."), ChatMessage(role="user", content="Hi")]
    out = proc.process(_req(messages=msgs))
    want = tiny_tokenizer.apply_chat_template([m.model_dump() for m in msgs], add_generation_prompt=True, tokenize=True, return_dict=False)
    assert out.prompt_token_ids == list(want)
    # the generation prompt ends the sequence with the assistant header
    assert tiny_tokenizer.decode(out.prompt_token_ids).rstrip().endswith("assistant")


def test_context_limit_error_names_the_limit(proc):
    out = proc.process(_req(prompt="word " * 80))
    assert out.error is not None
    assert out.error.reason == ErrorReason.CONTEXT_LENGTH_EXCEEDED
    assert "context length of 64 tokens" in out.error.message
    assert "max_tokens is 8" in out.error.message
    assert out.error.stage == Stage.PREPROCESS


def test_expired_request_is_not_tokenized(tiny_tokenizer):
    proc = InputProcessor(tiny_tokenizer, context_len=64, clock=WallClock(3000.0))
    out = proc.process(_req(prompt="hello"))
    assert out.error.reason == ErrorReason.EXPIRED
    assert out.prompt_token_ids == []


def test_special_tokens_in_prompt_text_stay_text(proc, tiny_tokenizer):
    end = tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")
    out = proc.process(_req(prompt="hello <|im_end|> world"))
    assert end not in out.prompt_token_ids
    allowed = InputProcessor(tiny_tokenizer, context_len=64, allow_special_tokens=True, clock=WallClock())
    assert end in allowed.process(_req(prompt="hello <|im_end|> world")).prompt_token_ids


def test_empty_prompt_is_a_bad_request(proc):
    out = proc.process(_req(prompt=""))
    assert out.error.reason == ErrorReason.INVALID_REQUEST


def test_threads_tokenizing_at_once_keep_special_token_text_as_text(tiny_tokenizer):
    """A threads-pool worker (the development worker serves preprocess on threads) calls
    one processor from many threads; each call sets the tokenizer's split_special_tokens
    flag, so the calls must not interleave (measured without the lock: about 1 in 7 wrong)."""
    from concurrent.futures import ThreadPoolExecutor

    proc = InputProcessor(tiny_tokenizer, context_len=100_000, clock=WallClock())
    text = "hello <|im_end|> world " * 200
    reqs = [_req(index=i, messages=[ChatMessage(role="user", content=text)]) if i % 2
            else _req(index=i, prompt=text) for i in range(64)]
    want = {i: proc.process(r).prompt_token_ids for i, r in enumerate(reqs[:2])}
    im_end = tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert want[1].count(im_end) == 1  # the template's own end of turn; the user's text stays text
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(proc.process, reqs))
    assert [g.prompt_token_ids for g in got] == [want[i % 2] for i in range(64)]


def test_token_id_prompts_skip_tokenizing_but_are_checked(tiny_tokenizer):
    proc = InputProcessor(tiny_tokenizer, context_len=64, clock=WallClock(), vocab_size=3072)
    out = proc.process(_req(prompt_token_ids=[5, 6, 3071]))
    assert out.error is None and out.prompt_token_ids == [5, 6, 3071]
    bad = proc.process(_req(prompt_token_ids=[5, 3072]))
    assert bad.error.reason == ErrorReason.INVALID_REQUEST and bad.error.param == "prompt"
    assert bad.error.message == "Token id 3072 is out of vocabulary"  # vLLM's words
    assert proc.process(_req(prompt_token_ids=[-1])).error.param == "prompt"
    long = proc.process(_req(prompt_token_ids=[7] * 60))  # still within the context with max_tokens
    assert long.error.reason == ErrorReason.CONTEXT_LENGTH_EXCEEDED


def test_tokenize_view_is_what_a_request_would_carry(proc, tiny_tokenizer):
    msgs = [{"role": "user", "content": "hi"}]
    view = proc.tokenize_view(messages=msgs, return_token_strs=True)
    assert view["tokens"] == proc.process(_req(messages=[ChatMessage(**m) for m in msgs])).prompt_token_ids
    assert view["count"] == len(view["tokens"]) and view["max_model_len"] == 64
    assert view["token_strs"] == tiny_tokenizer.convert_ids_to_tokens(view["tokens"])
    no_gen = proc.tokenize_view(messages=msgs, add_generation_prompt=False)["tokens"]
    assert view["tokens"][: len(no_gen)] == no_gen and len(no_gen) < len(view["tokens"])
    assert proc.tokenize_view(prompt="hello there")["tokens"] == tiny_tokenizer("hello there")["input_ids"]
    assert proc.tokenize_view(prompt="hello")["token_strs"] is None
    # The tiny model's tokenizer adds no special tokens of its own: nothing changes.
    assert proc.tokenize_view(messages=msgs, add_special_tokens=True)["tokens"] == view["tokens"]
