"""What the benchmark scripts share: the recorded workloads the tables run on and the line that
names the machine and versions a table was measured with."""

from __future__ import annotations

import datetime as dt
import os
import platform
import subprocess
from pathlib import Path

RECORDED = [  # (label, model, flags) recorded with --fake on the a100-40gb profile
    ("GPT-2 small b8 s1024", "gpt2", {"batch": 8, "seq": 1024}),
    ("BERT-base b8 s512", "bert", {"batch": 8, "seq": 512}),
    ("Llama 8L h1024 b4 s1024", "llama", {}),
    ("ResNet-50 b32 224", "resnet50", {"batch": 32}),
    ("ViT-base b32 224", "vit", {"batch": 32}),
]


def machine() -> str:
    import ortools
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    return (f"{dt.date.today().isoformat()}, commit {commit or '?'}, {os.cpu_count()} cores ({cpu}), "
            f"Python {platform.python_version()}, torch {torch.__version__}, OR-Tools {ortools.__version__}")
