"""Prepare the embedded default model ahead of time (e.g. before launching many ranks) and print its path.

    python scripts/prepare_default_model.py [--quiet]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from models.weights.default_model import ensure_default_model


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--quiet", action="store_true", help="no progress messages on stderr"
    )
    args = ap.parse_args()
    try:
        path = ensure_default_model(quiet=args.quiet)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
