"""Entry point: ``python launch.py`` (or under ``torchrun``) with YAML configs and key=value overrides.

    python launch.py                                   # configs/default.yaml: built-in prompts
    python launch.py --config my.yaml cache.page_size=1
    python launch.py job.input=rows.jsonl job.output=out.jsonl
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from runtime.config import ConfigError, load_config, to_yaml

DEFAULT_CONFIG = Path(__file__).parent / "configs" / "default.yaml"


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="tpinfer: tensor-parallel offline inference for Llama-family models")
    parser.add_argument("--config", action="append", default=None, help="YAML config (repeatable; merged in order)")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. cache.page_size=1")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        cfg = load_config(args.config or [DEFAULT_CONFIG], args.overrides)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.print_config:
        print(to_yaml(cfg), end="")
        return 0
    logging.basicConfig(level=cfg.logging.level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    from runtime.llm import LLM

    try:
        llm = LLM(config=cfg)
    except (FileNotFoundError, ValueError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if cfg.job.input:
        from runtime.job import run_job

        if not cfg.job.output:
            print("error: job.input is set but job.output is not", file=sys.stderr)
            return 2
        try:
            counts = run_job(llm, Path(cfg.job.input), Path(cfg.job.output))
        except OSError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        stats = llm.last_stats
        print(f"{counts['ok']} rows done, {counts['errors']} errors -> {cfg.job.output}; "
              f"{stats.get('output_tokens', 0)} tokens at {stats.get('tokens_per_s', 0):.1f} tokens/s")
        return 0
    prompts = [[{"role": "user", "content": p}] if cfg.job.chat_template else p for p in cfg.job.prompts]
    outputs = llm.generate(prompts)
    for prompt, out in zip(cfg.job.prompts, outputs):
        print(f"### {prompt}\n{out.error if out.error else out.text}\n")
    stats = llm.last_stats
    print(f"{stats['output_tokens']} tokens in {stats['seconds']:.2f} s: {stats['tokens_per_s']:.1f} tokens/s "
          f"({llm.engine.device.type}, {len(outputs)} requests)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
