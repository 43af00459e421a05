"""Write an HF-format checkpoint with the benchmark's random weights (what ``model.random_weights=true`` draws).

    python scripts/make_random_checkpoint.py configs/models/llama-3.2-1b /tmp/llama-1b-random [--seed 0]

Drawn exactly as the engine draws them, so it equals ``model.random_weights=true`` on the same kind of device.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models.config import ModelConfig  # noqa: E402
from models.weights.loader import checkpoint_shapes, random_checkpoint_tensor  # noqa: E402

SHARD_BYTES = 2 << 30


def write_random_checkpoint(config_dir: Path, out: Path, seed: int = 0, dtype: torch.dtype = torch.bfloat16,
                            device: torch.device | None = None) -> Path:
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = ModelConfig.from_dir(config_dir)
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(config_dir / "config.json", out / "config.json")
    shard: dict[str, torch.Tensor] = {}
    index: dict[str, str] = {}
    files: list[Path] = []

    def flush() -> None:
        if shard:
            file = out / f"model-{len(files) + 1:05d}.safetensors"
            save_file(shard, str(file), metadata={"format": "pt"})
            files.append(file)
            index.update({name: file.name for name in shard})
            shard.clear()

    size = 0
    for name, shape in checkpoint_shapes(cfg).items():
        shard[name] = random_checkpoint_tensor(name, shape, seed, device, dtype).cpu()
        size += shard[name].numel() * shard[name].element_size()
        if size >= SHARD_BYTES:
            flush()
            size = 0
    flush()
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}, indent=1))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config_dir", type=Path, help="directory with an HF config.json")
    parser.add_argument("out", type=Path)
    parser.add_argument("--seed", type=int, default=0, help="engine.seed of the runs it should equal")
    args = parser.parse_args()
    print(write_random_checkpoint(args.config_dir, args.out, args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
