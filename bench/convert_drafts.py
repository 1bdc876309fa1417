#!/usr/bin/env python3
"""Which DFlash drafts are plain-rope? Each release's own converter, on a tiny draft, measured (issue 37).

Upstream's answer to a closed PR for this bug was "already fixed, reconvert your GGUF": from some release on,
the converter writes M-RoPE sections (`dflash.rope.dimension_sections`) into a draft whose target uses
M-RoPE, and a draft with sections may jump over an image's span (X < Y), so it never fails. This measures,
release by release, which drafts come out plain-rope: a tiny DFlash checkpoint (random weights, written here
with safetensors, shaped like dfbuild's fixture drafts) is converted by the tree's own
`convert_hf_to_gguf.py` (its `conversion` package and `gguf-py`) against a tiny target config of each
shape below, and the GGUF it writes is read back.

    python bench/convert_drafts.py --python PY TREE...      # PY: a Python with torch, safetensors, transformers
    python bench/convert_drafts.py --smoke-only --keep K --smoke unpatched=U --smoke patched=P   # kept drafts

With --smoke LABEL=BUILD (a build dir of the release --smoke-base names, default b11434), each draft converted
by that release's converter is then run in that build's llama-server beside dfbuild's tiny qwen35 target
(random weights, 2-D grid projector), in the scenario of the bug (pinned-image-hole: the text after an image):
whether it fails unpatched is measured, not inferred.

Only the tokenizer is not the converter's: the draft's `set_vocab` (which needs the target's tokenizer
files and transformers' AutoTokenizer) is replaced by one that writes dfbuild's fixture vocabulary, so that
the converted draft loads beside dfbuild's tiny qwen35 target; everything else, `set_gguf_parameters`
included, is the release's own code. Results: bench/convert_drafts.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

# the target configs a draft is converted against: where the target's M-RoPE sections are written, if anywhere
TEXT = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6, "vocab_size": 259,
        "max_position_embeddings": 4096}
SECTIONS = [3, 3, 2]
TARGETS = {
    # transformers 5 writes every rope setting under rope_parameters (Qwen3.5's published configs)
    "qwen35 rope_parameters.mrope_section": {
        "architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
        "text_config": TEXT | {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                   "mrope_section": SECTIONS, "mrope_interleaved": True}}},
    # transformers 4 wrote them under rope_scaling (Qwen3-VL's published configs)
    "qwen3vl rope_scaling.mrope_section": {
        "architectures": ["Qwen3VLForConditionalGeneration"], "model_type": "qwen3_vl",
        "text_config": TEXT | {"rope_theta": 10000.0,
                               "rope_scaling": {"rope_type": "default", "mrope_section": SECTIONS,
                                                "mrope_interleaved": True}}},
    # both keys, the sections under the older one (a config carried across transformers versions)
    "qwen35 rope_parameters without, rope_scaling with mrope_section": {
        "architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
        "text_config": TEXT | {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
                               "rope_scaling": {"rope_type": "default", "mrope_section": SECTIONS}}},
    # no mrope_section at all: the model's code takes its default sections (an M-RoPE target all the same)
    "qwen35 no mrope_section (the model's default)": {
        "architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
        "text_config": TEXT | {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}},
}

DRAFT_CONFIG = {
    "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 4096, "vocab_size": 259,
    "tie_word_embeddings": False, "torch_dtype": "float32", "block_size": 4,
    # extract layers 1 and 3 (target_layer_ids + 1), as dfbuild's fixture drafts read
    "dflash_config": {"block_size": 4, "target_layer_ids": [0, 2], "mask_token_id": 257},
}

# Runs inside the tree's environment (argv: tree, draft dir, target dir, out file, vocab json)
DRIVER = r'''
import json, sys
from pathlib import Path
tree, draft, target, out, vocab = sys.argv[1:6]
sys.path[:0] = [tree, str(Path(tree) / "gguf-py")]
import convert_hf_to_gguf as c
cls = c.get_model_class("DFlashDraftModel")
v = json.loads(Path(vocab).read_text())
def set_vocab(self):  # dfbuild's fixture vocabulary instead of the target's tokenizer files
    w = self.gguf_writer
    w.add_tokenizer_model("gpt2"); w.add_tokenizer_pre("default")
    w.add_token_list(v["tokens"]); w.add_token_types(v["token_types"]); w.add_token_merges(v["merges"])
    w.add_bos_token_id(v["eos"]); w.add_eos_token_id(v["eos"]); w.add_add_bos_token(False)
    if hasattr(w, "add_mask_token_id"):
        w.add_mask_token_id(v["mask"])
cls.set_vocab = set_vocab
sys.argv = ["convert_hf_to_gguf.py", draft, "--target-model-dir", target, "--outfile", out, "--outtype", "f32"]
c.main()
'''

READER = r'''
import json, sys
from pathlib import Path
sys.path[:0] = [str(Path(sys.argv[1]) / "gguf-py")]
import gguf
r = gguf.GGUFReader(sys.argv[2])
keys = {}
for name, field in r.fields.items():
    if "rope" in name or name in ("general.architecture",):
        keys[name] = field.contents() if hasattr(field, "contents") else str(field.parts[-1].tolist())
print(json.dumps(keys, default=str))
'''


def write_draft(folder: Path, python: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(DRAFT_CONFIG, indent=1))
    code = r'''
import sys, torch
from safetensors.torch import save_file
g = torch.Generator().manual_seed(37)
def n(*s): return (torch.randn(*s, generator=g) * 0.2).contiguous()
def ones(*s): return torch.ones(*s)
t = {"model.fc.weight": n(64, 128), "model.hidden_norm.weight": ones(64), "model.norm.weight": ones(64),
     "model.layers.0.input_layernorm.weight": ones(64), "model.layers.0.post_attention_layernorm.weight": ones(64),
     "model.layers.0.self_attn.q_proj.weight": n(64, 64), "model.layers.0.self_attn.k_proj.weight": n(32, 64),
     "model.layers.0.self_attn.v_proj.weight": n(32, 64), "model.layers.0.self_attn.o_proj.weight": n(64, 64),
     "model.layers.0.self_attn.q_norm.weight": ones(16), "model.layers.0.self_attn.k_norm.weight": ones(16),
     "model.layers.0.mlp.gate_proj.weight": n(128, 64), "model.layers.0.mlp.up_proj.weight": n(128, 64),
     "model.layers.0.mlp.down_proj.weight": n(64, 128)}
save_file(t, sys.argv[1] + "/model.safetensors", metadata={"format": "pt"})
'''
    subprocess.run([python, "-c", code, str(folder)], check=True)


def vocab_file(folder: Path) -> Path:
    sys.path.insert(0, str(REPO / "src"))
    from dfbuild.smoke import fixtures
    from dfbuild.smoke.fixtures import models

    kv = models._tokenizer_kv()
    path = folder / "vocab.json"
    path.write_text(json.dumps({"tokens": kv["tokenizer.ggml.tokens"], "token_types": kv["tokenizer.ggml.token_type"],
                                "merges": kv["tokenizer.ggml.merges"], "eos": fixtures.EOS_ID,
                                "mask": fixtures.MASK_ID}))
    return path


def sections_of(keys: dict) -> list[int] | None:
    for name, value in keys.items():
        if name.endswith("rope.dimension_sections"):
            return list(value) if isinstance(value, (list, tuple)) else value
    return None


def smoke_drafts(rows: list[dict], builds: list[str], work: Path, keep: Path) -> list[dict]:
    """Each kept draft in each build's llama-server, in the bug's scenario; what happened, per draft and build."""
    sys.path.insert(0, str(REPO / "src"))
    from dfbuild import smoke
    from dfbuild.smoke import fixtures

    fx = fixtures.ensure_fixtures(work / "fixtures")
    scenario = smoke.SCENARIOS["pinned-image-hole"]
    results = []
    for row in rows:
        for item in builds:
            label, _, build = item.partition("=")
            entry = dict(fx["sets"]["qwen35-grid-plain-random"], draft=str(keep / row["kept"]))
            name = f"{row['base']}-{row['target']}"
            r = smoke.run_scenario(smoke.server_binary(Path(build)), "converted", entry, scenario, fx["images"],
                                   work / "logs" / label / str(len(results)), compare_no_spec=False)
            results.append({"base": row["base"], "target": row["target"], "rope": row["rope"], "build": label,
                             "passed": r["passed"], "upstream_symptom": r["upstream_symptom"],
                             "statuses": r["statuses"], "fills": r["fills"],
                             "first_failure": (r["failures"] or [None])[0]})
            print(f"{label}: {name}: {'pass' if r['passed'] else 'FAIL'}", file=sys.stderr)
    return results


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--python", help="a Python with torch, safetensors and transformers (for converting)")
    p.add_argument("--keep", type=Path, help="keep the converted GGUFs here (base--target.gguf)")
    p.add_argument("--out", type=Path, default=HERE / "convert_drafts.json")
    p.add_argument("--smoke", action="append", default=[], metavar="LABEL=BUILD",
                   help="run the kept drafts of --smoke-base in this build's llama-server (repeatable)")
    p.add_argument("--smoke-base", default="b11434")
    p.add_argument("--smoke-only", action="store_true", help="no conversion: smoke the drafts --out's record kept")
    p.add_argument("--work", type=Path, default=Path("convert-drafts-work"), help="fixtures and logs of --smoke")
    p.add_argument("trees", nargs="*", type=Path, help="llama.cpp trees (e.g. dfbuild apply's), each named bNNNN")
    args = p.parse_args()
    if args.smoke_only:
        data = json.loads(args.out.read_text(encoding="utf-8"))
        kept = [r for r in data["rows"] if r["base"] == args.smoke_base and r.get("kept")]
        if args.keep is None:
            p.error("--smoke-only needs --keep, the folder the converted drafts were kept in")
        data["smoke"] = smoke_drafts(kept, args.smoke, args.work, args.keep)
        args.out.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
        print(f"wrote {args.out}", file=sys.stderr)
        return 0

    if not args.python:
        p.error("converting needs --python, a Python with torch, safetensors and transformers")
    rows = []
    with tempfile.TemporaryDirectory(prefix="convert-drafts-") as tmp:
        tmp = Path(tmp)
        draft = tmp / "draft"
        write_draft(draft, args.python)
        vocab = vocab_file(tmp)
        for tree in args.trees:
            base = tree.name if tree.name.startswith("b") else tree.parent.name
            for label, config in TARGETS.items():
                target = tmp / "target" / str(len(rows))
                target.mkdir(parents=True)
                (target / "config.json").write_text(json.dumps(config, indent=1))
                out = tmp / f"{base}-{len(rows)}.gguf"
                run = subprocess.run([args.python, "-c", DRIVER, str(tree), str(draft), str(target), str(out),
                                      str(vocab)], capture_output=True, text=True)
                row = {"base": base, "target": label, "converted": run.returncode == 0}
                if run.returncode != 0:
                    row["error"] = (run.stderr.strip().splitlines() or ["?"])[-1][:300]
                else:
                    keys = json.loads(subprocess.run([args.python, "-c", READER, str(tree), str(out)],
                                                     capture_output=True, text=True, check=True).stdout)
                    row["sections"] = sections_of(keys)
                    row["rope"] = "M-RoPE" if row["sections"] else "plain"
                    row["rope_keys"] = keys
                    if args.keep:
                        args.keep.mkdir(parents=True, exist_ok=True)
                        kept = args.keep / f"{base}--{len(rows) % len(TARGETS)}.gguf"
                        kept.write_bytes(out.read_bytes())
                        row["kept"] = kept.name  # in --keep
                print(f"{base}: {label}: {row.get('rope', row.get('error'))} {row.get('sections', '')}",
                      file=sys.stderr)
                rows.append(row)
    args.out.write_text(json.dumps({"targets": TARGETS, "draft": DRAFT_CONFIG, "rows": rows}, indent=1) + "\n",
                        encoding="utf-8")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
