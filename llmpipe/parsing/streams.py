"""A streamed chat output parsed as it is generated, in the inference worker that makes it
(llmpipe/jobs/streaming.py TokenPublisher): its ids are decoded with vLLM's detokenizer
(llmpipe/processors/detokenize.py) and fed to vLLM's parse_delta one token at a time, as
vLLM's chat server feeds it, so the delta messages (content, reasoning, tool_calls) are
vLLM's. The API relays them (api/openai/sse.py); the stream's last chunk completes the
answer from postprocess's result.

The last id seen is held back until the next one or the end: vLLM parses the final token
with ``finished=True`` (the parsers flush what they held), and only the end tells whether
that token stopped the output (its text is then left out)."""

from __future__ import annotations

from collections.abc import Callable

from llmpipe.messages import Detokenizing
from llmpipe.parsing.vllm_parsers import StreamParse
from llmpipe.processors.detokenize import IncrementalDetokenizer


class ParsedStream:
    """``prefix``: ids this output already streamed (a request run again): fed without output."""

    def __init__(self, parse: StreamParse, detok: IncrementalDetokenizer, prefix: list[int] | None = None):
        self.parse = parse
        self.detok = detok
        self.fed = 0
        self.finished = False
        if prefix:
            self.advance(prefix)

    def advance(self, ids: list[int], *, final: bool = False, stop_terminated: bool = False) -> tuple[int, list[dict]]:
        """Parse ``ids[self.fed:]`` (all of them when ``final``, else all but the last);
        returns how many ids are parsed now and the delta messages they made."""
        upto = len(ids) if final else len(ids) - 1
        deltas: list[dict] = []
        while self.fed < upto:
            k = self.fed
            self.fed += 1
            if self.finished:
                continue  # after a stop string: ids the engine made past it have no text
            last = final and k == len(ids) - 1
            stopped = self.detok.update([ids[k]], stop_terminated=last and stop_terminated) is not None
            self.finished = last or stopped
            msg = self.parse.push(self.detok.next_text(self.finished), [ids[k]], self.finished)
            if msg is not None:
                deltas.append(msg)
        return self.fed, deltas


def make_stream(parse: StreamParse, tokenizer, prompt_tail: list[int], stop: list[str], opts: Detokenizing,
                prefix: list[int] | None = None) -> ParsedStream:
    return ParsedStream(parse, IncrementalDetokenizer(tokenizer, prompt_tail, stop, opts), prefix)


StreamFactory = Callable[..., ParsedStream | None]
