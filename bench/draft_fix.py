"""What `dfbuild draft check` and `draft fix` cost on large drafts (issue 43), measured side by side:

- reading the header: gguf-py's GGUFReader against dfbuild.draft.header, on a draft with a real-size
  vocabulary (250,000 tokens and merges) and a multi-GB data section (sparse: no disk is used for it);
- `dfbuild draft fix` as a user runs it (a subprocess): wall time and peak RSS (ru_maxrss of the child),
  on a draft of a few hundred MB whose bytes are real (not sparse), against its size.

    python bench/draft_fix.py [--vocab 250000] [--sparse-gb 3] [--fix-mb 384] [--results bench/draft_fix.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
TIME = "/usr/bin/time"  # GNU time (Debian: apt-get install time)


def write_large_draft(path: Path, *, vocab: int = 260, data_bytes: int = 1 << 20, dense: bool = True,
                      seed: int = 0) -> Path:
    """A DFlash draft GGUF (the fixture draft's keys, head_dim 128) whose one big F16 tensor holds DATA_BYTES.

    dense: random bytes written out (a real copy to make); else the file is extended sparsely (zeros, no
    disk used), with a few random blocks so a tensor hash still sees its content."""
    import gguf

    n_embd = 4096
    rows = max(1, data_bytes // (2 * n_embd))
    writer = gguf.GGUFWriter(str(path), "dflash")
    writer.add_uint32("dflash.block_count", 1)
    writer.add_uint32("dflash.embedding_length", n_embd)
    writer.add_uint32("dflash.attention.head_count", 32)
    writer.add_uint32("dflash.attention.key_length", 128)
    writer.add_uint32("dflash.block_size", 16)
    writer.add_array("dflash.target_layers", [2, 10, 18, 26, 34])
    writer.add_string("tokenizer.ggml.model", "gpt2")
    writer.add_array("tokenizer.ggml.tokens", [f"tok{i}" for i in range(vocab)])
    writer.add_array("tokenizer.ggml.merges", [f"t ok{i}" for i in range(vocab)])
    writer.add_array("tokenizer.ggml.token_type", [1] * vocab)
    writer.add_tensor_info("blk.0.attn_norm.weight", (n_embd,), np.dtype(np.float32), 4 * n_embd)
    writer.add_tensor_info("fc.weight", (rows, n_embd), np.dtype(np.float16), 2 * rows * n_embd)
    writer.add_tensor_info("output_norm.weight", (n_embd,), np.dtype(np.float32), 4 * n_embd)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    handle = writer.fout[0]
    writer.write_padding(handle, handle.tell())
    data_start = handle.tell()
    handle.write(rng.standard_normal(n_embd).astype(np.float32).tobytes())  # 16 KiB: already 32-aligned
    big = 2 * rows * n_embd
    if dense:
        for start in range(0, big, 64 << 20):
            handle.write(rng.integers(0, 256, min(64 << 20, big - start), dtype=np.uint8).tobytes())
    else:
        for where in (0, big // 2, big - 4096):
            handle.seek(data_start + 4 * n_embd + where)
            handle.write(rng.integers(0, 256, 4096, dtype=np.uint8).tobytes())
        handle.seek(data_start + 4 * n_embd + big)
    handle.write(np.ones(n_embd, dtype=np.float32).tobytes())
    writer.close()
    return path


def _run_child(argv: list[str]) -> tuple[float, int, int]:
    """(wall seconds, peak RSS in KiB, exit status) of one command, measured by GNU time.

    Not wait4's rusage: Linux carries the forking parent's high-water RSS into a child's ru_maxrss across
    exec (this script holds hundreds of MB after writing the dense draft), while time(1) forks from a
    process of a few MB."""
    start = time.perf_counter()
    proc = subprocess.run([TIME, "-f", "%M", *argv], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wall = time.perf_counter() - start
    return wall, int(proc.stderr.split()[-1]), proc.returncode


def _reader_cost(code: str) -> dict:
    wall, rss, rc = _run_child([sys.executable, "-c", code])
    return {"wall_s": round(wall, 3), "peak_rss_mib": round(rss / 1024, 1), "rc": rc}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=250_000)
    parser.add_argument("--sparse-gb", type=float, default=3.0)
    parser.add_argument("--fix-mb", type=int, default=384)
    parser.add_argument("--results", type=Path, default=HERE / "draft_fix.json")
    parser.add_argument("--work", type=Path, default=None, help="scratch dir (default: a temp dir, removed)")
    args = parser.parse_args()
    dfbuild = shutil.which("dfbuild") or str(Path(sys.executable).with_name("dfbuild"))
    work = args.work or Path(tempfile.mkdtemp(prefix="draft-fix-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    fixtures = work / "fixtures"
    subprocess.run([dfbuild, "-q", "fixtures", "--out", str(fixtures)], check=True, stdout=subprocess.DEVNULL)
    target = fixtures / "target-qwen35-random.gguf"
    record: dict = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                    "command": "python bench/draft_fix.py " + " ".join(sys.argv[1:]),
                    "cores": os.cpu_count(), "load_average_at_start": [round(x, 2) for x in os.getloadavg()]}
    try:
        sparse = write_large_draft(work / "sparse.gguf", vocab=args.vocab, data_bytes=int(args.sparse_gb * (1 << 30)),
                                   dense=False)
        record["header"] = {
            "file_bytes": sparse.stat().st_size, "vocab": args.vocab,
            "gguf_reader": _reader_cost(f"import gguf; gguf.GGUFReader({str(sparse)!r})"),
            "draft_gguf": _reader_cost(f"from dfbuild.draft import header; header.read_header({str(sparse)!r})"),
        }
        wall, rss, rc = _run_child([dfbuild, "draft", "check", str(sparse), "--target", str(target), "--json"])
        record["header"]["draft_check"] = {"wall_s": round(wall, 3), "peak_rss_mib": round(rss / 1024, 1), "rc": rc}
        sparse.unlink()
        dense = write_large_draft(work / "dense.gguf", vocab=args.vocab, data_bytes=args.fix_mb << 20, dense=True)
        out = work / "fixed.gguf"
        wall, rss, rc = _run_child([dfbuild, "draft", "fix", str(dense), "--target", str(target), "--out", str(out)])
        record["fix"] = {"file_bytes": dense.stat().st_size, "wall_s": round(wall, 2),
                         "peak_rss_mib": round(rss / 1024, 1), "rc": rc,
                         "peak_rss_per_file_size": round(rss * 1024 / dense.stat().st_size, 4),
                         "mb_per_s": round(dense.stat().st_size / wall / 1e6, 1)}
        record["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
        baseline = _reader_cost("import dfbuild.cli")
        record["python_baseline"] = baseline  # what the interpreter and dfbuild's imports take alone
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    args.results.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
