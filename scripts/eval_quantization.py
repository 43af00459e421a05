"""How far a quantised model is from the same weights unquantised: teacher-forced on the same text, and greedy.

    python scripts/eval_quantization.py [--model default] [--prompts 200] [--variants weights,kv,both]
        [--prompt-tokenizer MODEL] [--out benchmarks/fp8-quality.json] [key=value ...]

Variants: FP8 weights (model.quantization=fp8), an FP8 KV cache (cache.dtype=fp8_e4m3), and both.

The text is the unquantised model's own greedy replies to 200 chat prompts (no dataset is downloaded). Both
models read prompt + reply (prompt logprobs, fresh models so no prefix is cached); per reply token we compare
the top-1 prediction and the token's log-likelihood. Then the quantised model answers the same prompts
greedily: where does it first differ? A model without a tokenizer (random benchmark weights) reads the prompts
as ``--prompt-tokenizer``'s chat template encodes them (default: the embedded model's).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime import LLM, SamplingParams  # noqa: E402

TOPICS = ["the ocean", "volcanoes", "bread", "the moon", "chess", "rain", "bees", "libraries", "trains",
          "mountains", "coffee", "music", "gardens", "snow", "bridges", "computers", "rivers", "birds",
          "the desert", "cities", "forests", "clocks", "bicycles", "tea", "stars"]
STYLES = ["Write two sentences about {}.", "Explain {} to a child.", "List three facts about {}.",
          "Why do people like {}?", "Describe {} in one paragraph.", "What is the history of {}?",
          "Give a tip about {}.", "Write a short poem about {}."]


def chat_prompts(count: int) -> list[list[dict[str, str]]]:
    texts = [style.format(topic) for style in STYLES for topic in TOPICS][:count]
    return [[{"role": "user", "content": t}] for t in texts]


def teacher_forced(model: str, overrides: list[str], seqs: list[list[int]]) -> list[list[dict]]:
    """Each sequence's prompt logprobs (with the top-1 token) from a fresh model."""
    llm = LLM(model, overrides=overrides)
    outs = llm.generate(seqs, SamplingParams(temperature=0, max_new_tokens=1, prompt_logprobs=1))
    llm.shutdown()
    return [o.prompt_logprobs for o in outs]


def encode(model: str, conversations: list, overrides: list[str]) -> list[list[int]]:
    llm = LLM(model, overrides=overrides)
    ids = [llm.encode(c) for c in conversations]
    llm.shutdown()
    return ids


VARIANTS = {
    "weights": ["model.quantization=fp8"],
    "kv": ["cache.dtype=fp8_e4m3"],
    "both": ["model.quantization=fp8", "cache.dtype=fp8_e4m3"],
}


def compare(model: str, overrides: list[str], prompt_ids: list[list[int]], replies: list,
            seqs: list[list[int]], ref: list[list[dict]], greedy: SamplingParams) -> dict:
    """Teacher-forced agreement on the reference replies (``seqs``: prompt + reply), then where the variant's own
    greedy replies differ."""
    ours = teacher_forced(model, overrides, seqs)
    agree, nll_change = [], []
    for a, b, prompt in zip(ref, ours, prompt_ids):
        for x, y in zip(a[len(prompt):], b[len(prompt):]):  # the reply's tokens
            agree.append(x["top"][0][0] == y["top"][0][0])
            nll_change.append(x["logprob"] - y["logprob"])
    quant = LLM(model, overrides=overrides)
    generated = quant.generate(prompt_ids, greedy)
    quant.shutdown()
    first_diff = []
    for r, g in zip(replies, generated):
        pairs = list(zip(r.token_ids, g.token_ids))
        first_diff.append(next((i for i, (x, y) in enumerate(pairs) if x != y), len(pairs)))
    return {
        "overrides": overrides,
        "top1_agreement": sum(agree) / len(agree),
        "mean_nll_change_per_token": statistics.fmean(nll_change),
        "mean_abs_logprob_change_per_token": statistics.fmean(map(abs, nll_change)),
        "greedy_identical_replies": sum(d == len(r.token_ids) for d, r in zip(first_diff, replies)),
        "greedy_first_difference_median": statistics.median(first_diff),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--variants", default="weights,kv,both", help=f"comma-separated, of {list(VARIANTS)}")
    parser.add_argument("--prompts", type=int, default=200)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokenizer", default=None,
                        help="model whose chat template encodes the prompts (default: --model's own)")
    parser.add_argument("--out", default=None)
    parser.add_argument("overrides", nargs="*", help="config overrides for both models, e.g. engine.device=cpu")
    args = parser.parse_args()
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    greedy = SamplingParams(temperature=0, max_new_tokens=args.new_tokens)
    conversations = chat_prompts(args.prompts)
    base_overrides = ["model.quantization=none", *args.overrides]
    prompt_ids = encode(args.prompt_tokenizer, conversations, args.overrides) if args.prompt_tokenizer else None
    base = LLM(args.model, overrides=base_overrides)
    prompt_ids = prompt_ids or [base.encode(c) for c in conversations]
    replies = base.generate(prompt_ids, greedy)
    base.shutdown()
    del base  # its memory goes before the next model loads
    seqs = [p + r.token_ids for p, r in zip(prompt_ids, replies)]
    ref = teacher_forced(args.model, base_overrides, seqs)
    result = {
        "model": args.model, "prompt_tokenizer": args.prompt_tokenizer or args.model, "prompts": len(conversations), "reply_tokens": sum(len(r.token_ids) for r in replies),
        "command": " ".join(sys.argv),
        "variants": {v: compare(args.model, [*base_overrides, *VARIANTS[v]], prompt_ids, replies, seqs, ref, greedy)
                     for v in variants},
    }
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
