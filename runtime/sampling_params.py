"""Per-request sampling parameters, validated when a request is made."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

MAX_LOGPROBS = 20
MAX_N = 128
SEED_LIMIT = 2**63  # seeds are in [0, SEED_LIMIT): the sampler keys its noise by a signed 64-bit integer
# Below this a temperature samples the argmax (as vLLM treats it): 1/t would overflow float32 near 3e-39, and
# logits scaled by 1e5 already leave no other token a chance.
GREEDY_TEMPERATURE = 1e-5
# Well inside float32: near 8.5e37 1/t stops being a normal float32 and flushes to 0, and a -inf logit times 0
# is NaN, which wins the draw. At 1e30 every finite logit is already equally likely.
MAX_TEMPERATURE = 1e30
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
MAX_PENALTY = 2.0  # OpenAI's bound on presence and frequency penalties
MAX_LOGIT_BIAS = 100.0  # OpenAI's bound: -100 bans a token, 100 all but forces it
# Far past any useful value (transformers suggests about 1.2), either way; logit / penalty stays a normal float32.
MAX_REPETITION_PENALTY = 1e6
_INT_FIELDS = ("top_k", "max_new_tokens", "seed", "logprobs", "prompt_logprobs", "n")


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 (or below GREEDY_TEMPERATURE) means greedy
    top_k: int = -1  # -1 (or 0) keeps the whole vocabulary
    top_p: float = 1.0
    min_p: float = 0.0  # keeps tokens at least this fraction as likely as the likeliest; 0 keeps all
    # Penalties on logits (greedy rows too): presence and frequency subtract from tokens already generated (once,
    # and per occurrence, as OpenAI); repetition divides positive logits (multiplies negative ones) of tokens in
    # the prompt or the output (as transformers). The neutral values leave the logits untouched.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit, before penalties
    max_new_tokens: int = 256
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None  # None: off; k: each sampled token's logprob and its top-k alternatives
    prompt_logprobs: int | None = None  # the same for every prompt token after the first
    n: int = 1  # independent samples of the prompt (they share its prefill through the prefix cache)

    def __post_init__(self) -> None:
        self.validate()

    @property
    def adjusts_logits(self) -> bool:
        """A penalty or a logit bias changes this request's logits before it samples."""
        return (self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1
                or bool(self.logit_bias))

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    def validate(self) -> None:
        """Strict types: JSON ``"false"`` is not a bool, ``true`` is not a number, ``null`` is not a list. Run
        again for every request, so fields changed after construction are checked too; a string ``stop`` becomes
        a list of one."""
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        # NumPy scalars (a seed from np.random, a count from an array) are numbers too: kept as Python ones, which
        # the checks below and the JSON written with the results take.
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, numbers.Integral) and not isinstance(value, (int, bool)):
                setattr(self, name, int(value))
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, numbers.Real) and not isinstance(value, (int, float, bool)):
                setattr(self, name, float(value))
        if isinstance(self.stop_token_ids, list):
            self.stop_token_ids = [int(t) if isinstance(t, numbers.Integral) and not isinstance(t, bool) else t
                                   for t in self.stop_token_ids]

        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"sampling parameter {name}={getattr(self, name)!r} {why}")

        self.logit_bias = _token_biases(self.logit_bias, bad)

        def is_int(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_number(v: object) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool) and _finite(v)

        if not is_number(self.temperature) or not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise bad("temperature", f"must be a number in [0, {MAX_TEMPERATURE:g}] (0 means greedy)")
        if not is_int(self.top_k) or self.top_k < -1:
            raise bad("top_k", "must be an integer >= 1, or -1/0 to disable")
        if not is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be a number in (0, 1]")
        if not is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be a number in [0, 1] (0 disables)")
        for name in ("presence_penalty", "frequency_penalty"):
            if not is_number(getattr(self, name)) or not -MAX_PENALTY <= getattr(self, name) <= MAX_PENALTY:
                raise bad(name, f"must be a number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}] (0 disables)")
        low, high = 1 / MAX_REPETITION_PENALTY, MAX_REPETITION_PENALTY
        if not is_number(self.repetition_penalty) or not low <= self.repetition_penalty <= high:
            raise bad("repetition_penalty", f"must be a number in [{low:g}, {high:g}] (1 disables)")
        if not is_int(self.max_new_tokens) or self.max_new_tokens <= 0:
            raise bad("max_new_tokens", "must be an integer > 0")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", "must be a string or a list of non-empty strings")
        if not isinstance(self.stop_token_ids, list) or not all(is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be a list of integer token ids >= 0")
        if not isinstance(self.ignore_eos, bool):
            raise bad("ignore_eos", "must be true or false (a JSON boolean, not a string)")
        if self.seed is not None and (not is_int(self.seed) or not 0 <= self.seed < SEED_LIMIT):
            raise bad("seed", "must be an integer in [0, 2**63)")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise bad(name, f"must be null (off) or an integer in [0, {MAX_LOGPROBS}] (alternatives per token)")
        if not is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise bad("n", f"must be an integer in [1, {MAX_N}]")

    @classmethod
    def from_dict(cls, values: dict[str, Any], base: SamplingParams | None = None) -> SamplingParams:
        """Build from a JSON-like dict, on top of ``base``; unknown names are an error."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s) {unknown}; known: {sorted(known)}")
        merged = {f.name: getattr(base, f.name) for f in fields(cls)} if base else {}
        merged.update(values)
        return cls(**merged)


def _finite(value: numbers.Real) -> bool:
    """``math.isfinite`` that says False, rather than raising, for an int past float's range (JSON allows 1e400
    written as digits)."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def token_id(key: object) -> int | None:
    """A mapping key as a token id: a non-negative integer or its decimal string (JSON and most YAML writers
    write mapping keys as strings: "50256"); None for anything else."""
    if isinstance(key, str) and key.isascii() and key.isdigit():
        return int(key)
    if isinstance(key, numbers.Integral) and not isinstance(key, bool) and key >= 0:
        return int(key)
    return None


def _token_biases(biases: object, bad: Callable[[str, str], ValueError]) -> dict[int, float]:
    """``logit_bias`` with int keys and float values."""
    why = (f"must map token ids (integers, or their decimal strings as JSON writes them) to numbers in "
           f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
    if not isinstance(biases, Mapping):
        raise bad("logit_bias", why)
    out: dict[int, float] = {}
    for key, value in biases.items():
        token = token_id(key)
        if token is None:
            raise bad("logit_bias", why)
        if not isinstance(value, numbers.Real) or isinstance(value, bool) or not _finite(value) \
                or abs(value) > MAX_LOGIT_BIAS:
            raise bad("logit_bias", why)
        if token in out:
            raise bad("logit_bias", f"names token {token} twice")
        out[token] = float(value)
    return out
