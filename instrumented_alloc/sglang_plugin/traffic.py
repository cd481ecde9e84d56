"""Seeded traffic for SGLang (its ``Engine`` or its HTTP server): what the demo on the real engine, the plugin's
tests and its benchmark send. Pure: builds the requests, sends nothing.

- ``prefix_waves``: waves of requests that share a few long prefixes (system prompts, few-shot examples), sent
  one wave after the other, so that every wave after the first hits the prefix cache that the ones before it
  filled; output lengths vary, so requests finish, release and hand their pages to the cache at different steps.
- ``decode_batch``: one batch of requests with short prompts and long generations (decode-heavy).
- ``Stream``: an endless stream of such requests, one at a time, and requests tagged for a fault (the demo).

Token ids are drawn from ``3 .. vocab - 1`` (0-2 are the tiny model's special tokens).
"""

from __future__ import annotations

import random
import uuid
from dataclasses import dataclass, field


@dataclass
class Wave:
    input_ids: list = field(default_factory=list)
    max_new_tokens: list = field(default_factory=list)
    rids: list = field(default_factory=list)

    def sampling_params(self, *, ignore_eos: bool = True) -> list:
        return [{"max_new_tokens": n, "ignore_eos": ignore_eos, "temperature": 0.0} for n in self.max_new_tokens]


def _tokens(rng: random.Random, n: int, vocab: int) -> list:
    return [rng.randrange(3, vocab) for _ in range(n)]


def rid(rng: random.Random, tag: str = "") -> str:
    """A request id: ``tag`` (e.g. a fault's, see ``faults.tag``) then 16 hex digits from ``rng``."""
    return (f"{tag}-" if tag else "") + uuid.UUID(int=rng.getrandbits(128)).hex[:16]


def prefix_waves(
    seed: int,
    *,
    waves: int = 3,
    per_wave: int = 16,
    prefixes: int = 4,
    prefix_lens=(24, 48, 80),
    suffix=(1, 40),
    new_tokens=(4, 64),
    vocab: int = 32000,
) -> list[Wave]:
    rng = random.Random(seed)
    heads = [_tokens(rng, rng.choice(prefix_lens), vocab) for _ in range(prefixes)]
    out = []
    for _ in range(waves):
        w = Wave()
        for _ in range(per_wave):
            w.input_ids.append(rng.choice(heads) + _tokens(rng, rng.randint(*suffix), vocab))
            w.max_new_tokens.append(rng.randint(*new_tokens))
            w.rids.append(rid(rng))
        out.append(w)
    return out


def decode_batch(seed: int, *, n: int, prompt_len: int = 32, new_tokens: int = 128, vocab: int = 32000) -> Wave:
    rng = random.Random(seed)
    w = Wave()
    for _ in range(n):
        w.input_ids.append(_tokens(rng, prompt_len, vocab))
        w.max_new_tokens.append(new_tokens)
        w.rids.append(rid(rng))
    return w


@dataclass(frozen=True)
class Request:
    input_ids: list
    max_new_tokens: int
    rid: str

    def body(self, *, ignore_eos: bool = True) -> dict:
        """The JSON body of SGLang's HTTP ``/generate`` for this request."""
        return {
            "input_ids": self.input_ids,
            "rid": self.rid,
            "sampling_params": {"max_new_tokens": self.max_new_tokens, "ignore_eos": ignore_eos, "temperature": 0.0},
        }


class Stream:
    """An endless, seeded stream of requests sharing a few long prefixes, with long generations (``next_request``),
    and requests tagged for a fault on the same prefixes (``tagged``): what ``demo --engine sglang`` sends.

    The same seed gives the same requests in the same order (their scheduling on the server is the server's); the
    tagged requests draw from a generator of their own, so asking for one leaves the stream unchanged."""

    def __init__(
        self,
        seed: int,
        *,
        prefixes: int = 4,
        prefix_lens=(24, 48, 80),
        suffix=(1, 40),
        new_tokens=(16, 128),
        vocab: int = 32000,
    ):
        self.seed = seed
        self.vocab = vocab
        self.suffix, self.new_tokens = suffix, new_tokens
        self._rng = random.Random(seed)
        self.heads = [_tokens(self._rng, self._rng.choice(prefix_lens), vocab) for _ in range(prefixes)]

    def next_request(self) -> Request:
        rng = self._rng
        ids = rng.choice(self.heads) + _tokens(rng, rng.randint(*self.suffix), self.vocab)
        return Request(ids, rng.randint(*self.new_tokens), rid(rng))

    def tagged(self, tag: str, *, suffix: int = 12, new_tokens: int = 64) -> Request:
        """One request whose id starts with ``tag``, on the longest shared prefix: long enough (prompt and
        generation) for the sliding window to evict part of it on the hybrid model."""
        rng = random.Random(f"{self.seed}:{tag}")
        head = max(self.heads, key=len)
        return Request(head + _tokens(rng, suffix, self.vocab), new_tokens, rid(rng, tag))
