"""PromptRequest -> TokenizedRequest: chat template, tokenization and limits."""

from __future__ import annotations

import time
from typing import Any

from llmpipe.errors import BadRequestError, ContextLengthError
from llmpipe.messages import PromptRequest, Stage, StageError, TokenizedRequest
from llmpipe.processors.envelope import WallClock, run_stage


class InputProcessor:
    def __init__(self, tokenizer: Any, context_len: int, *, allow_special_tokens: bool = False, clock: WallClock = time.time):
        self.tokenizer = tokenizer
        self.context_len = context_len
        self.allow_special_tokens = allow_special_tokens
        self._clock = clock

    def process(self, req: PromptRequest) -> TokenizedRequest:
        return run_stage(Stage.PREPROCESS, req, self._tokenize, self._failed, self._clock)

    def token_ids(self, req: PromptRequest) -> list[int]:
        if req.messages is not None:
            if not req.messages:
                raise BadRequestError("messages must not be empty", param="messages")
            convo = [m.model_dump() for m in req.messages]
            ids = self.tokenizer.apply_chat_template(convo, add_generation_prompt=True, tokenize=True, return_dict=False)
            if isinstance(ids, dict) or hasattr(ids, "keys"):
                ids = ids["input_ids"]
            return list(ids)
        assert req.prompt is not None
        if not req.prompt:
            raise BadRequestError("prompt must not be empty", param="prompt")
        # Special tokens written as text (e.g. "<|im_end|>") stay text unless allowed.
        enc = self.tokenizer(req.prompt, add_special_tokens=True, split_special_tokens=not self.allow_special_tokens)
        return list(enc["input_ids"])

    def _tokenize(self, req: PromptRequest) -> TokenizedRequest:
        ids = self.token_ids(req)
        n, m = len(ids), req.params.max_tokens
        if n + m > self.context_len:
            raise ContextLengthError(
                f"prompt has {n} tokens and max_tokens is {m}: {n + m} exceeds the model's context "
                f"length of {self.context_len} tokens",
                param="max_tokens",
            )
        return TokenizedRequest(
            job_id=req.job_id, index=req.index, deadline=req.deadline, enqueued_at=req.enqueued_at,
            prompt_token_ids=ids, params=req.params, stream=req.stream,
        )

    @staticmethod
    def _failed(req: PromptRequest, error: StageError) -> TokenizedRequest:
        return TokenizedRequest(
            job_id=req.job_id, index=req.index, deadline=req.deadline, enqueued_at=req.enqueued_at,
            prompt_token_ids=[], params=req.params, error=error,
        )
