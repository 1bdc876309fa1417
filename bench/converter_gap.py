#!/usr/bin/env python3
"""Which target configs get a DFlash draft with M-RoPE sections, per llama.cpp tree's converter (issue 43)?

bench/convert_drafts.py answers it by converting a draft (it needs torch, safetensors and transformers: the
device's image has them). This asks the converter's own decision directly, where neither is installed: it
imports the tree's `conversion` package with torch, safetensors and transformers stubbed (nothing of theirs runs
on this path) and calls `DFlashModel._target_uses_mrope` on convert_drafts.py's target configs, plus a linear
Qwen3 target whose draft must stay plain-rope. A tree per argument, each labelled by its folder's name:

    python bench/converter_gap.py BEFORE_TREE AFTER_TREE [--out bench/upstream/converter-b11434/converter_gap.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

# run in a fresh interpreter per tree: the two trees' `conversion` packages share a name
PROBE = r'''
import json, sys, tempfile, types
from pathlib import Path
tree, bench = Path(sys.argv[1]), sys.argv[2]
sys.path[:0] = [str(tree), str(tree / "gguf-py"), bench]

class _AnyAttr(type):
    def __getattr__(cls, name):
        return _Stub

class _Stub(metaclass=_AnyAttr):
    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        return _Stub()

    def __getattr__(self, name):
        return _Stub()

for name in ("torch", "torch.nn", "torch.nn.functional", "safetensors", "safetensors.torch", "transformers",
             "transformers.convert_slow_tokenizer", "sentencepiece", "mistral_common"):
    module = types.ModuleType(name)
    module.__getattr__ = lambda attr: _Stub
    module.__path__ = []
    sys.modules[name] = module

from convert_drafts import TARGETS, TEXT
from conversion.qwen import DFlashModel

targets = dict(TARGETS)
targets["qwen3 (linear rope)"] = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", **TEXT,
                                  "rope_theta": 10000.0}
decided = {}
for label, config in targets.items():
    folder = Path(tempfile.mkdtemp())
    (folder / "config.json").write_text(json.dumps(config))
    decided[label] = DFlashModel._target_uses_mrope(types.SimpleNamespace(target_model_dir=folder))
print(json.dumps(decided))
'''


def decide(tree: Path) -> dict[str, bool]:
    run = subprocess.run([sys.executable, "-c", PROBE, str(tree), str(HERE)], capture_output=True, text=True)
    if run.returncode:
        raise SystemExit(f"{tree}: {run.stderr.strip()[-2000:]}")
    return json.loads(run.stdout)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trees", nargs="+", type=Path, help="llama.cpp trees (the converter before and after)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    record = {"question": "DFlashModel._target_uses_mrope(target config): does the draft get "
                          "dflash.rope.dimension_sections?",
              "trees": {tree.name: decide(tree) for tree in args.trees}}
    text = json.dumps(record, indent=1) + "\n"
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text, encoding="utf-8")
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
