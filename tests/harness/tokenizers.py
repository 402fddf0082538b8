"""A tokenizer for unit tests that need no model: one token a word."""

from __future__ import annotations


class WordTokenizer:
    """One token a word, and a BOS: enough for the bench's prompt builder."""

    def __init__(self):
        self.words = ["<s>"]
        self.ids: dict[str, int] = {}

    def _id(self, word: str) -> int:
        if word not in self.ids:
            self.ids[word] = len(self.words)
            self.words.append(word)
        return self.ids[word]

    def __call__(self, text: str, add_special_tokens: bool = True, **_):
        return {"input_ids": ([0] if add_special_tokens else []) + [self._id(w) for w in text.split()]}

    def decode(self, ids: list[int]) -> str:
        return " ".join(self.words[i] for i in ids)
