"""What a measurement ran on: versions, device and code revision, for benchmark and eval records."""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

import torch


def git_revision(repo: str | Path) -> str:
    """``QP_GIT_SHA`` if set (the device machine has no git history), else ``git rev-parse HEAD``,
    marked when tracked files have uncommitted changes; ``unknown`` outside a repository."""
    if os.environ.get("QP_GIT_SHA"):
        return os.environ["QP_GIT_SHA"]
    try:
        run = dict(cwd=repo, capture_output=True, text=True, check=True)
        sha = subprocess.run(["git", "rev-parse", "HEAD"], **run).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], **run).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return sha + (" (uncommitted changes)" if dirty else "")


def environment_info(device: str | torch.device = "cpu", repo: str | Path = ".") -> dict:
    """Date, command, Python/torch/Triton/Transformers/CUDA versions, the device and the git revision."""
    device = torch.device(device)
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(shlex.quote(a) for a in sys.argv),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "machine": platform.platform(),
        "cpu_count": os.cpu_count(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "git_sha": git_revision(repo),
    }
    if device.type == "cuda":
        info["cudnn"] = torch.backends.cudnn.version()
        info["gpu"] = info["device"]
    for name in ("triton", "transformers"):
        try:
            info[name] = __import__(name).__version__
        except ImportError:
            info[name] = None
    return info


def write_json(path: str | Path, record: dict) -> Path:
    """Write an eval/benchmark ``record`` as indented JSON to ``path`` (parent folders created)."""
    import json

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2))
    return path
