"""PromptRequest -> TokenizedRequest: chat template (llmpipe/processors/chat_render.py),
tokenization, truncation, the sampling checks that need the model
(llmpipe/processors/prompt_checks.py), vLLM's adjusting of a chat request by the model's
parsers (llmpipe/parsing/vllm_parsers.py), and limits."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

from llmpipe.errors import BadRequestError, ContextLengthError
from llmpipe.messages import ChatMessage, ChatTemplate, PromptRequest, SamplingParams, Stage, StageError, TokenizedRequest
from llmpipe.processors import chat_render, prompt_checks
from llmpipe.processors.envelope import WallClock, run_stage


class InputProcessor:
    """``parser``: the model's ModelParser (llmpipe/parsing/vllm_parsers.py) when the model has
    parsers; chat requests are then adjusted by them, as vLLM's chat server does."""

    def __init__(self, tokenizer: Any, context_len: int, *, allow_special_tokens: bool = False, clock: WallClock = time.time,
                 vocab_size: int | None = None, parser: Any = None):
        self.tokenizer = tokenizer
        self.context_len = context_len
        # Token-id prompts are checked against the larger of the model's and the tokenizer's
        # vocabularies, as vLLM does (some models have ids the tokenizer lacks, and back).
        self.vocab_size = max(vocab_size or 0, len(tokenizer))
        # Ids a request names (logit_bias, allowed_token_ids) index the model's logits (vLLM's bound).
        self.model_vocab = vocab_size or len(tokenizer)
        self.allow_special_tokens = allow_special_tokens
        self.parser = parser
        self._clock = clock
        # Each tokenizer call sets the tokenizer's own split_special_tokens flag before it
        # encodes: on a threads pool (a development worker) calls that interleave would
        # parse a user's "<|im_end|>" as a control token. One call at a time per process.
        self._lock = threading.Lock()

    def process(self, req: PromptRequest) -> TokenizedRequest:
        return run_stage(Stage.PREPROCESS, req, self._tokenize, self._failed, self._clock)

    def token_ids(self, req: PromptRequest) -> list[int]:
        if req.prompt_token_ids is not None:
            return self._checked_ids(req.prompt_token_ids)
        if req.messages is not None:
            return self.chat_ids(req.messages, req.chat)
        assert req.prompt is not None
        if not req.prompt:
            raise BadRequestError("prompt must not be empty", param="prompt")
        keep = prompt_checks.keep_tokens(req.params, self.context_len)
        if keep is not None and req.params.truncation_side is None:
            return self.prompt_ids(req.prompt, truncate_to=keep)
        return self.prompt_ids(req.prompt)

    def prompt_ids(self, text: str, *, add_special_tokens: bool = True, truncate_to: int | None = None) -> list[int]:
        """``truncate_to``: the tokenizer truncates, from the left (vLLM's tokenizer side for
        generation), keeping the special tokens it adds, as vLLM's text prompts are truncated."""
        # Special tokens written as text (e.g. "<|im_end|>") stay text unless allowed.
        kw = {} if truncate_to is None else {"truncation": True, "max_length": truncate_to}
        side = self.tokenizer.truncation_side
        self.tokenizer.truncation_side = "left"
        try:
            enc = self.tokenizer(text, add_special_tokens=add_special_tokens,
                                 split_special_tokens=not self.allow_special_tokens, **kw)
        finally:
            self.tokenizer.truncation_side = side
        return list(enc["input_ids"])

    def chat_ids(self, messages: list[ChatMessage] | list[dict], chat: ChatTemplate | None = None) -> list[int]:
        """The ids of a conversation through the chat template, as vLLM renders and tokenizes it."""
        if not messages:
            raise BadRequestError("messages must not be empty", param="messages")
        msgs = [m if isinstance(m, ChatMessage) else ChatMessage.model_validate(m) for m in messages]
        chat = chat or ChatTemplate()
        conv = chat_render.conversation(msgs)
        if not self.allow_special_tokens:
            self._refuse_special_markup(conv, chat)
        if not self.allow_special_tokens and any(self._holds_special(m["content"]) for m in conv):
            ids = self._chat_ids_with_text_contents(conv, chat)
        else:
            ids = self._encode(chat_render.render(self.tokenizer, conv, chat), split_special=False)
        if chat.add_special_tokens:  # on top of the template's own (vLLM's default: off)
            prefix, suffix = self._special_wrap()
            ids = prefix + ids + suffix
        return ids

    def _refuse_special_markup(self, conv: list[dict], chat: ChatTemplate) -> None:
        """Message contents keep special-token text as text (below); the other text a template
        renders (tools, documents, tool calls, reasoning, names) may not hold any."""
        fields = {"tools": chat.tools, "documents": chat.documents, "chat_template_kwargs": chat.kwargs,
                  "messages": [{k: v for k, v in m.items() if k not in ("role", "content")} for m in conv]}
        for name, value in fields.items():
            if value and self._holds_special(json.dumps(value, ensure_ascii=False)):
                raise BadRequestError(f"{name} holds special-token text, which only message contents may (as text)",
                                      param=name)

    def tokenize_view(self, *, prompt: str | None = None, messages: list[dict] | None = None,
                      add_special_tokens: bool | None = None, add_generation_prompt: bool = True,
                      return_token_strs: bool = False) -> dict:
        """``POST /tokenize``: the ids this stage would feed the engine, in vLLM's shape."""
        with self._lock:
            if messages is not None:
                chat = ChatTemplate(add_generation_prompt=add_generation_prompt, add_special_tokens=bool(add_special_tokens))
                ids = self.chat_ids(messages, chat)
            else:
                ids = self.prompt_ids(prompt or "", add_special_tokens=True if add_special_tokens is None else add_special_tokens)
        strs = self.tokenizer.convert_ids_to_tokens(ids) if return_token_strs else None
        return {"count": len(ids), "max_model_len": self.context_len, "tokens": ids, "token_strs": strs}

    def _special_wrap(self) -> tuple[list[int], list[int]]:
        """The ids the tokenizer adds before and after a text (a BOS, say)."""
        core = self.tokenizer("a", add_special_tokens=False)["input_ids"]
        full = self.tokenizer("a", add_special_tokens=True)["input_ids"]
        for i in range(len(full) - len(core) + 1):
            if full[i : i + len(core)] == core:
                return list(full[:i]), list(full[i + len(core):])
        return [], []

    def _checked_ids(self, ids: list[int]) -> list[int]:
        """A prompt given as token ids is not tokenized, only checked (vLLM's messages)."""
        if not ids:
            raise BadRequestError("prompt must not be empty", param="prompt")
        lo, hi = min(ids), max(ids)
        if lo < 0 or hi >= self.vocab_size:
            raise BadRequestError(f"Token id {lo if lo < 0 else hi} is out of vocabulary", param="prompt")
        return list(ids)

    def _holds_special(self, text: str) -> bool:
        specials = getattr(self, "_specials", None)
        if specials is None:
            names = set(getattr(self.tokenizer, "all_special_tokens", []) or [])
            for tok in (getattr(self.tokenizer, "added_tokens_decoder", {}) or {}).values():
                if getattr(tok, "special", False):
                    names.add(str(tok))
            specials = self._specials = tuple(t for t in names if t)
        return any(t in text for t in specials)

    def _chat_ids_with_text_contents(self, conv: list[dict], chat: ChatTemplate) -> list[int]:
        """The chat template's own markup becomes control tokens; message contents never do.

        A user writing "<|im_end|>" in a message must not close their turn and open another
        (prompt injection into the chat structure). The template is rendered with a
        placeholder per content, then the markup between placeholders is tokenized with
        special tokens parsed and each content with them split into plain text."""
        marks = [f"\x00llmpipe-content-{i}\x00" for i in range(len(conv))]
        rendered = chat_render.render(self.tokenizer, [{**m, "content": mark} for m, mark in zip(conv, marks, strict=True)],
                                      chat)
        ids: list[int] = []
        rest = rendered
        for m, mark in zip(conv, marks, strict=True):
            head, sep, rest = rest.partition(mark)
            if not sep:  # the template changed the content: refuse rather than guess
                raise BadRequestError("message content holds special-token text that this model's chat template "
                                      "cannot keep as plain text", param="messages")
            ids += self._encode(head, split_special=False) + self._encode(m["content"], split_special=True)
        return ids + self._encode(rest, split_special=False)

    def _encode(self, text: str, *, split_special: bool) -> list[int]:
        if not text:
            return []
        return list(self.tokenizer(text, add_special_tokens=False, split_special_tokens=split_special)["input_ids"])

    def _tokenize(self, req: PromptRequest) -> TokenizedRequest:
        with self._lock:
            ids = self.token_ids(req)
            params = self._checked_params(req.params)
        ids = prompt_checks.truncate(ids, params, self.context_len)
        parsing, reasoning_ended = None, None
        if req.parsing is not None and self.parser is not None and self.parser.cls is not None:
            params, reasoning_ended = self._adjusted(req, params, ids)
            parsing = req.parsing
        n, m = len(ids), params.max_tokens
        if n + m > self.context_len:
            raise ContextLengthError(
                f"prompt has {n} tokens and max_tokens is {m}: {n + m} exceeds the model's context "
                f"length of {self.context_len} tokens",
                param="max_tokens",
            )
        return TokenizedRequest(
            job_id=req.job_id, index=req.index, deadline=req.deadline, enqueued_at=req.enqueued_at,
            prompt_token_ids=ids, params=params, stream=req.stream, priority=req.priority, model=req.model,
            parsing=parsing, reasoning_ended=reasoning_ended,
        )

    def _checked_params(self, p: SamplingParams) -> SamplingParams:
        """vLLM's checks that need the model; the bad words as token ids (the transformers engine's)."""
        prompt_checks.check_vocab(p, self.model_vocab)
        if not p.bad_words:
            return p
        ids = prompt_checks.bad_words_token_ids(self.tokenizer, p.bad_words, self.vocab_size - 1)
        return p.model_copy(update={"bad_words_token_ids": ids})

    def _adjusted(self, req: PromptRequest, params: SamplingParams, ids: list[int]) -> tuple[SamplingParams, bool | None]:
        """vLLM's adjust_request by the model's parsers (guided decoding for a forced tool call...)."""
        from llmpipe.parsing.vllm_parsers import adjust_errors

        # As the client sent them (tool call arguments as JSON text): vLLM's request validates them.
        messages = [m.model_dump(exclude_none=True) for m in req.messages or []]
        with adjust_errors():
            return self.parser.adjust(req.parsing, params, messages, ids)

    @staticmethod
    def _failed(req: PromptRequest, error: StageError) -> TokenizedRequest:
        return TokenizedRequest(
            job_id=req.job_id, index=req.index, deadline=req.deadline, enqueued_at=req.enqueued_at,
            prompt_token_ids=[], params=req.params, error=error, priority=req.priority, model=req.model,
        )
