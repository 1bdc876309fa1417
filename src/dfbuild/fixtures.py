"""Tiny, seeded GGUF fixtures that reproduce the DFlash-on-images bug in seconds.

Everything here is written with the PyPI `gguf` package; no weights are ever
downloaded. The key names, tensor names and shapes come from the llama.cpp trees
(b10359 and b11312): `src/llama-arch.cpp`, `src/models/{llama,qwen35,dflash}.cpp`,
`tools/mtmd/clip.cpp` / `clip-impl.h` and `conversion/qwen.py` (DFlashModel).

A fixture *set* is what one smoke run loads together: a target, an mmproj and a
DFlash draft. The sets:

* ``llama-mlp-random`` / ``llama-mlp-agree``: a llama target with an `mlp`
  projector. Image rows get linear positions there, so the bug never shows; it
  is the control.
* ``qwen35-{mlp,grid}-{plain,sections}-{agree,disagree}`` and
  ``qwen35-grid-plain-random``: a tiny `qwen35`
  target (hybrid gated-delta-net + attention, M-RoPE). mtmd picks the M-RoPE
  image layout from the decoder's rope type, so every projector gives image rows
  one shared temporal position and the text after an image resumes further on.
  That opens the positional hole in the draft's KV cache. ``grid`` is a
  `qwen2vl_merger` projector (more rows than positions, the case that needs the
  noise-block-base concern). ``plain`` drafts have no rope sections (converted
  before 2026-08-27); ``sections`` drafts carry
  ``dflash.rope.dimension_sections = [head_dim/2, 0, 0, 0]`` (honoured by b11312,
  ignored by b10359).

``write_bench_fixtures`` writes the qwen35 agree sets again at a larger `Shape`
(``BENCH_SHAPE``: about 160 M parameters, F16) for bench/spec_images.py, where
decoding must dominate a request; `write_fixtures` keeps the tiny smoke shape.

"Agree" weights make acceptance a certainty instead of a hope: every target
token embedding is the same vector ``v``; attention/SSM/FFN output projections
are zero, so the residual stream at every text position is exactly ``v``; the
output row of one letter is ``v``, so the target always predicts that letter.
The draft shares the target's embeddings (and, when agreeing, its lm head), has
zero output projections too, so it predicts the same letter: 100% acceptance.
"Disagree" drafts carry their own lm head that predicts another letter: 0%.
"""

from __future__ import annotations

import hashlib
import json
import string
import struct
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from . import errors, owned, state
from .paths import sha256_file

FIXTURES_SCHEMA = 1
INDEX_NAME = "fixtures.json"

# --- vocabulary ---------------------------------------------------------------
# Byte-level BPE ("gpt2") over the 256 bytes, so every character is one token and
# any text (including the random media marker) tokenizes. Two special tokens and
# one merge, because llama.cpp refuses a BPE vocab without a merges array.
EOS_ID = 256
MASK_ID = 257
AGREE_LETTER = "a"


def _bytes_to_unicode() -> list[str]:
    """GPT-2's reversible byte -> printable-unicode table (index = byte value)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


BYTE_TOKENS = _bytes_to_unicode()
SPACE = BYTE_TOKENS[ord(" ")]
TOKENS = BYTE_TOKENS + ["<|endoftext|>", "<|MASK|>", SPACE + SPACE]
TOKEN_TYPES = [1] * 256 + [3, 3, 1]  # 1 = normal, 3 = control
MERGES = [f"{SPACE} {SPACE}"]
N_VOCAB = len(TOKENS)


def letter_token(letter: str) -> int:
    return BYTE_TOKENS.index(letter)


# --- shapes -------------------------------------------------------------------
N_EMBD = 64
N_HEAD = 4
N_HEAD_KV = 2
HEAD_DIM = 16
N_FF = 128
N_LAYER = 4
N_CTX_TRAIN = 4096
RMS_EPS = 1e-6
ROPE_BASE = 10000.0

# qwen35: layers 1 and 3 are full attention, 0 and 2 gated delta net
FULL_ATTENTION_INTERVAL = 2
ROPE_SECTIONS = [3, 3, 2, 0]  # pairs of rotated dims: 2 * sum == HEAD_DIM
SSM_CONV_KERNEL = 4
SSM_STATE = 16  # head_k_dim == head_v_dim
SSM_GROUPS = 2  # k heads
SSM_DT_RANK = 4  # v heads
SSM_INNER = SSM_STATE * SSM_DT_RANK

# DFlash draft: one layer, reads the inputs of target layers 1 and 3
DRAFT_LAYERS = 1
DRAFT_BLOCK_SIZE = 4
DRAFT_TARGET_LAYERS = [1, 3]

# vision towers
V_EMBD = 32
V_HEAD = 2
V_FF = 64
V_PATCH = 8
V_IMAGE_SIZE = 32
MM_HIDDEN = 64

# test images (width, height)
IMAGES = {"small": (32, 32), "large": (64, 48)}


@dataclass(frozen=True)
class Shape:
    """Sizes of the text models (targets and DFlash drafts) and the projectors' output width.

    The defaults are the tiny smoke shape above; `write_bench_fixtures` writes a
    larger one. `dtype` "f16" stores the large matrices as F16 (norms, biases,
    SSM parameters and the conv kernel stay F32, as llama.cpp's converters keep them).
    """

    n_embd: int = N_EMBD
    n_head: int = N_HEAD
    n_head_kv: int = N_HEAD_KV
    head_dim: int = HEAD_DIM
    n_ff: int = N_FF
    n_layer: int = N_LAYER
    full_attention_interval: int = FULL_ATTENTION_INTERVAL
    rope_sections: tuple[int, ...] = tuple(ROPE_SECTIONS)
    ssm_state: int = SSM_STATE
    ssm_groups: int = SSM_GROUPS
    ssm_dt_rank: int = SSM_DT_RANK
    draft_layers: int = DRAFT_LAYERS
    draft_block_size: int = DRAFT_BLOCK_SIZE
    draft_target_layers: tuple[int, ...] = tuple(DRAFT_TARGET_LAYERS)
    dtype: str = "f32"

    def to_dict(self) -> dict:
        """Plain JSON data (tuples as lists), as the fixtures index records it."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    @property
    def ssm_inner(self) -> int:
        return self.ssm_state * self.ssm_dt_rank

    def target_params(self) -> int:
        """Parameters of the qwen35 target (what the benchmark's size claim is about)."""
        e, hd = self.n_embd, self.head_dim
        attention = 2 * self.n_head * hd * e + 2 * self.n_head_kv * hd * e + self.n_head * hd * e + 2 * hd
        key_dim = self.ssm_state * self.ssm_groups
        conv_dim = 2 * key_dim + self.ssm_inner
        ssm = (conv_dim * e + 2 * self.ssm_inner * e + 2 * self.ssm_dt_rank * e + conv_dim * SSM_CONV_KERNEL
               + 2 * self.ssm_dt_rank + self.ssm_state)
        n_attention = self.n_layer // self.full_attention_interval
        per_layer_common = 3 * self.n_ff * e + 2 * e
        return (n_attention * attention + (self.n_layer - n_attention) * ssm + self.n_layer * per_layer_common
                + 2 * N_VOCAB * e + e)


SMOKE_SHAPE = Shape()
# Matrices written as F16 when Shape.dtype is "f16": those llama.cpp converters store in
# the model's type. 1-D tensors, ssm_conv1d, ssm_alpha/ssm_beta and ssm_a stay F32.
_F16_MATRICES = ("token_embd.weight", "output.weight", "fc.weight", "attn_q.weight", "attn_k.weight",
                 "attn_v.weight", "attn_output.weight", "attn_qkv.weight", "attn_gate.weight", "ssm_out.weight",
                 "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")


@dataclass(frozen=True)
class FixtureSet:
    name: str
    target: str
    mmproj: str
    draft: str
    arch: str
    projector: str
    draft_rope: str  # "plain" | "sections"
    agree: bool | None  # None: random weights, acceptance not predictable
    reproduces_bug: bool  # an M-RoPE target: image requests break an unpatched tree

    def expected_acceptance(self) -> str:
        return {True: "all", False: "none", None: "unknown"}[self.agree]


FILES = {
    "llama-random": "target-llama-random.gguf",
    "llama-agree": "target-llama-agree.gguf",
    "qwen35-random": "target-qwen35-random.gguf",
    "qwen35-agree": "target-qwen35-agree.gguf",
    "mmproj-mlp": "mmproj-mlp.gguf",
    "mmproj-grid": "mmproj-qwen2vl-merger.gguf",
    "draft-random": "draft-dflash-random.gguf",
    "draft-plain-agree": "draft-dflash-plain-agree.gguf",
    "draft-plain-disagree": "draft-dflash-plain-disagree.gguf",
    "draft-sections-agree": "draft-dflash-sections-agree.gguf",
    "draft-sections-disagree": "draft-dflash-sections-disagree.gguf",
}


def _fixture_sets() -> list[FixtureSet]:
    sets = [
        FixtureSet("llama-mlp-random", FILES["llama-random"], FILES["mmproj-mlp"], FILES["draft-random"],
                   "llama", "mlp", "plain", None, False),
        FixtureSet("llama-mlp-agree", FILES["llama-agree"], FILES["mmproj-mlp"], FILES["draft-plain-agree"],
                   "llama", "mlp", "plain", True, False),
    ]
    # random weights on the bug's path: greedy output is not trivially one letter,
    # so "identical to --spec-type none" checks something
    sets.append(FixtureSet("qwen35-grid-plain-random", FILES["qwen35-random"], FILES["mmproj-grid"],
                           FILES["draft-random"], "qwen35", "qwen2vl_merger", "plain", None, True))
    for projector_key, projector in (("mlp", "mlp"), ("grid", "qwen2vl_merger")):
        for rope in ("plain", "sections"):
            for agree in (True, False):
                flavour = "agree" if agree else "disagree"
                sets.append(FixtureSet(
                    f"qwen35-{projector_key}-{rope}-{flavour}",
                    FILES["qwen35-agree"], FILES[f"mmproj-{projector_key}"], FILES[f"draft-{rope}-{flavour}"],
                    "qwen35", projector, rope, agree, True,
                ))
    return sets


FIXTURE_SETS = {s.name: s for s in _fixture_sets()}


# --- GGUF writing ---------------------------------------------------------------

class _Weights:
    """Seeded generator of small float32 tensors, one stream per file.

    Shapes are numpy order (outermost first), i.e. the reverse of llama.cpp's
    `{ne0, ne1}` notation: ggml {n_embd, n_vocab} is numpy (n_vocab, n_embd).
    """

    def __init__(self, seed: int, stream: str):
        digest = hashlib.sha256(f"{seed}:{stream}".encode()).digest()
        self.rng = np.random.default_rng(int.from_bytes(digest[:8], "little"))

    def normal(self, *shape: int, scale: float = 0.02) -> np.ndarray:
        return (self.rng.standard_normal(shape) * scale).astype(np.float32)

    @staticmethod
    def ones(*shape: int) -> np.ndarray:
        return np.ones(shape, dtype=np.float32)

    @staticmethod
    def zeros(*shape: int) -> np.ndarray:
        return np.zeros(shape, dtype=np.float32)


def _write_gguf(path: Path, arch: str, kv: dict, tensors: dict[str, np.ndarray], dtype: str = "f32") -> None:
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in kv.items():
        _add_kv(writer, key, value)
    for name, data in tensors.items():
        f16 = dtype == "f16" and name.endswith(_F16_MATRICES) and data.ndim == 2
        writer.add_tensor(name, np.ascontiguousarray(data, dtype=np.float16 if f16 else np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _add_kv(writer, key: str, value) -> None:
    """Type the value the way llama.cpp's loaders expect (u32 ints, f32 floats, i32 arrays)."""
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    elif isinstance(value, list):
        writer.add_array(key, value)  # element type from the first item: int -> INT32, float -> F32
    else:  # pragma: no cover - a programming error in this module
        raise TypeError(f"{key}: unsupported value {value!r}")


def _tokenizer_kv() -> dict:
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": TOKENS,
        "tokenizer.ggml.token_type": TOKEN_TYPES,
        "tokenizer.ggml.merges": MERGES,
        "tokenizer.ggml.bos_token_id": EOS_ID,
        "tokenizer.ggml.eos_token_id": EOS_ID,
        "tokenizer.ggml.mask_token_id": MASK_ID,
        "tokenizer.ggml.add_bos_token": False,
    }


def _common_llm_kv(arch: str, n_layer: int, shape: Shape = SMOKE_SHAPE) -> dict:
    return {
        "general.name": f"dfbuild fixture {arch}",
        f"{arch}.context_length": N_CTX_TRAIN,
        f"{arch}.embedding_length": shape.n_embd,
        f"{arch}.block_count": n_layer,
        f"{arch}.feed_forward_length": shape.n_ff,
        f"{arch}.attention.head_count": shape.n_head,
        f"{arch}.attention.head_count_kv": shape.n_head_kv,
        f"{arch}.attention.key_length": shape.head_dim,
        f"{arch}.attention.value_length": shape.head_dim,
        f"{arch}.attention.layer_norm_rms_epsilon": RMS_EPS,
        f"{arch}.rope.dimension_count": shape.head_dim,
        f"{arch}.rope.freq_base": ROPE_BASE,
    }


def _agree_vector(w: _Weights, n_embd: int = N_EMBD) -> np.ndarray:
    v = w.rng.standard_normal(n_embd).astype(np.float32)
    return v / np.sqrt(np.mean(v * v))  # RMS 1, so rms_norm(v) == v


def _embeddings_and_head(w: _Weights, agree: bool, letter: str, shape: Shape = SMOKE_SHAPE) -> dict[str, np.ndarray]:
    n_embd = shape.n_embd
    if not agree:
        # Only ASCII letters get non-zero head rows: their best logit is positive
        # almost surely, so random models still write printable text. Raw random
        # bytes (invalid UTF-8, control tokens) make b10359's output parser answer
        # HTTP 500 ("does not match the expected Content-only format"), on
        # /completion too, which would hide the bug under test.
        head = w.zeros(N_VOCAB, n_embd)
        letters = [letter_token(c) for c in string.ascii_letters]
        head[letters] = w.normal(len(letters), n_embd, scale=0.5)
        return {
            "token_embd.weight": w.normal(N_VOCAB, n_embd, scale=1.0),
            "output_norm.weight": w.ones(n_embd),
            "output.weight": head,
        }
    v = _agree_vector(_Weights(0, "agree-vector"), n_embd)  # shared by every agree file, whatever the seed
    return {
        "token_embd.weight": np.tile(v, (N_VOCAB, 1)),
        "output_norm.weight": w.ones(n_embd),
        "output.weight": _letter_head(w, v, letter),
    }


def _letter_head(w: _Weights, v: np.ndarray, letter: str) -> np.ndarray:
    head = w.normal(N_VOCAB, len(v), scale=0.01)
    head[letter_token(letter)] = v
    return head


def _ffn(w: _Weights, prefix: str, agree: bool, shape: Shape = SMOKE_SHAPE) -> dict[str, np.ndarray]:
    n_embd, n_ff = shape.n_embd, shape.n_ff
    return {
        f"{prefix}.ffn_gate.weight": w.normal(n_ff, n_embd),
        f"{prefix}.ffn_up.weight": w.normal(n_ff, n_embd),
        f"{prefix}.ffn_down.weight": w.zeros(n_embd, n_ff) if agree else w.normal(n_embd, n_ff),
    }


def _llama_target(path: Path, seed: int, agree: bool) -> None:
    """src/models/llama.cpp: separate q/k/v, output optional (we write one)."""
    w = _Weights(seed, path.name)
    tensors = _embeddings_and_head(w, agree, AGREE_LETTER)
    for il in range(N_LAYER):
        p = f"blk.{il}"
        tensors.update({
            f"{p}.attn_norm.weight": w.ones(N_EMBD),
            f"{p}.attn_q.weight": w.normal(N_HEAD * HEAD_DIM, N_EMBD, scale=0.2),
            f"{p}.attn_k.weight": w.normal(N_HEAD_KV * HEAD_DIM, N_EMBD, scale=0.2),
            f"{p}.attn_v.weight": w.normal(N_HEAD_KV * HEAD_DIM, N_EMBD, scale=0.2),
            f"{p}.attn_output.weight": w.zeros(N_EMBD, N_HEAD * HEAD_DIM) if agree else w.normal(N_EMBD, N_HEAD * HEAD_DIM, scale=0.2),
            f"{p}.ffn_norm.weight": w.ones(N_EMBD),
        })
        tensors.update(_ffn(w, p, agree))
    kv = _common_llm_kv("llama", N_LAYER) | {"llama.vocab_size": N_VOCAB} | _tokenizer_kv()
    _write_gguf(path, "llama", kv, tensors)


def _qwen35_target(path: Path, seed: int, agree: bool, shape: Shape = SMOKE_SHAPE) -> None:
    """src/models/qwen35.cpp: hybrid gated-delta-net / gated attention, IMROPE."""
    w = _Weights(seed, path.name)
    tensors = _embeddings_and_head(w, agree, AGREE_LETTER, shape)
    n_embd, head_dim = shape.n_embd, shape.head_dim
    q_dim, kv_dim = shape.n_head * head_dim, shape.n_head_kv * head_dim
    key_dim = shape.ssm_state * shape.ssm_groups
    value_dim = shape.ssm_inner
    conv_dim = 2 * key_dim + value_dim
    for il in range(shape.n_layer):
        p = f"blk.{il}"
        tensors[f"{p}.attn_norm.weight"] = w.ones(n_embd)
        tensors[f"{p}.post_attention_norm.weight"] = w.ones(n_embd)
        is_attention = (il + 1) % shape.full_attention_interval == 0
        if is_attention:
            tensors.update({
                # q carries the output gate: twice the head width
                f"{p}.attn_q.weight": w.normal(2 * q_dim, n_embd, scale=0.2),
                f"{p}.attn_k.weight": w.normal(kv_dim, n_embd, scale=0.2),
                f"{p}.attn_v.weight": w.normal(kv_dim, n_embd, scale=0.2),
                f"{p}.attn_output.weight": w.zeros(n_embd, q_dim) if agree else w.normal(n_embd, q_dim, scale=0.2),
                f"{p}.attn_q_norm.weight": w.ones(head_dim),
                f"{p}.attn_k_norm.weight": w.ones(head_dim),
            })
        else:
            tensors.update({
                f"{p}.attn_qkv.weight": w.normal(conv_dim, n_embd, scale=0.2),
                f"{p}.attn_gate.weight": w.normal(value_dim, n_embd, scale=0.2),
                f"{p}.ssm_conv1d.weight": w.normal(conv_dim, SSM_CONV_KERNEL, scale=0.2),
                f"{p}.ssm_dt.bias": w.normal(shape.ssm_dt_rank, scale=0.1),
                f"{p}.ssm_a": -np.exp(w.normal(shape.ssm_dt_rank, scale=0.5)),  # -exp(A_log): decaying state
                f"{p}.ssm_beta.weight": w.normal(shape.ssm_dt_rank, n_embd, scale=0.2),
                f"{p}.ssm_alpha.weight": w.normal(shape.ssm_dt_rank, n_embd, scale=0.2),
                f"{p}.ssm_norm.weight": w.ones(shape.ssm_state),
                f"{p}.ssm_out.weight": w.zeros(n_embd, value_dim) if agree else w.normal(n_embd, value_dim, scale=0.2),
            })
        tensors.update(_ffn(w, p, agree, shape))
    kv = _common_llm_kv("qwen35", shape.n_layer, shape) | {
        "qwen35.rope.dimension_sections": list(shape.rope_sections),
        "qwen35.full_attention_interval": shape.full_attention_interval,
        "qwen35.ssm.conv_kernel": SSM_CONV_KERNEL,
        "qwen35.ssm.inner_size": shape.ssm_inner,
        "qwen35.ssm.state_size": shape.ssm_state,
        "qwen35.ssm.time_step_rank": shape.ssm_dt_rank,
        "qwen35.ssm.group_count": shape.ssm_groups,
    } | _tokenizer_kv()
    _write_gguf(path, "qwen35", kv, tensors, shape.dtype)


def _dflash_draft(path: Path, seed: int, flavour: str, rope_sections: bool, shape: Shape = SMOKE_SHAPE) -> None:
    """src/models/dflash.cpp + conversion/qwen.py DFlashModel.

    The draft has no token_embd and no lm head: it borrows the target's through
    ctx_other, as every DFlash loader since b9837 accepts (an own `output.weight`
    is optional from b10588 on, and b10355's loader refuses a file that has one).
    A disagreeing draft is the agreeing one with its final norm negated: its
    hidden state is the agree vector v, the target's head row for the agree letter
    is v, so -v scores that letter lowest and the draft never proposes it.
    """
    w = _Weights(seed, path.name)
    agree = flavour in ("agree", "disagree")
    n_embd, head_dim = shape.n_embd, shape.head_dim
    q_dim, kv_dim = shape.n_head * head_dim, shape.n_head_kv * head_dim
    tensors: dict[str, np.ndarray] = {
        "fc.weight": w.normal(n_embd, len(shape.draft_target_layers) * n_embd, scale=0.2),
        "enc.output_norm.weight": w.ones(n_embd),
        "output_norm.weight": -w.ones(n_embd) if flavour == "disagree" else w.ones(n_embd),
    }
    for il in range(shape.draft_layers):
        p = f"blk.{il}"
        tensors.update({
            f"{p}.attn_norm.weight": w.ones(n_embd),
            f"{p}.attn_q.weight": w.normal(q_dim, n_embd, scale=0.2),
            f"{p}.attn_k.weight": w.normal(kv_dim, n_embd, scale=0.2),
            f"{p}.attn_v.weight": w.normal(kv_dim, n_embd, scale=0.2),
            f"{p}.attn_output.weight": w.zeros(n_embd, q_dim) if agree else w.normal(n_embd, q_dim, scale=0.2),
            f"{p}.attn_q_norm.weight": w.ones(head_dim),
            f"{p}.attn_k_norm.weight": w.ones(head_dim),
            f"{p}.ffn_norm.weight": w.ones(n_embd),
        })
        tensors.update(_ffn(w, p, agree, shape))
    kv = _common_llm_kv("dflash", shape.draft_layers, shape) | {
        "dflash.block_size": shape.draft_block_size,
        "dflash.target_layers": list(shape.draft_target_layers),
    } | _tokenizer_kv()
    if rope_sections:
        kv["dflash.rope.dimension_sections"] = [head_dim // 2, 0, 0, 0]
    _write_gguf(path, "dflash", kv, tensors, shape.dtype)


def _vision_layer(w: _Weights, il: int) -> dict[str, np.ndarray]:
    p = f"v.blk.{il}"
    t = {}
    for name in ("attn_q", "attn_k", "attn_v", "attn_out"):
        t[f"{p}.{name}.weight"] = w.normal(V_EMBD, V_EMBD, scale=0.2)
        t[f"{p}.{name}.bias"] = w.normal(V_EMBD, scale=0.02)
    for name in ("ln1", "ln2"):
        t[f"{p}.{name}.weight"] = w.ones(V_EMBD)
        t[f"{p}.{name}.bias"] = w.zeros(V_EMBD)
    # shapes differ (n_ff != n_embd) so clip.cpp's legacy up/down swap never triggers
    t[f"{p}.ffn_up.weight"] = w.normal(V_FF, V_EMBD, scale=0.2)
    t[f"{p}.ffn_up.bias"] = w.zeros(V_FF)
    t[f"{p}.ffn_down.weight"] = w.normal(V_EMBD, V_FF, scale=0.2)
    t[f"{p}.ffn_down.bias"] = w.zeros(V_EMBD)
    return t


def _clip_kv(projector: str, n_layer: int, n_embd: int = N_EMBD) -> dict:
    return {
        "general.name": f"dfbuild fixture mmproj {projector}",
        "clip.projector_type": projector,
        "clip.has_vision_encoder": True,
        "clip.vision.embedding_length": V_EMBD,
        "clip.vision.feed_forward_length": V_FF,
        "clip.vision.block_count": n_layer,
        "clip.vision.projection_dim": n_embd,  # the text model's width
        "clip.vision.attention.head_count": V_HEAD,
        "clip.vision.attention.layer_norm_epsilon": 1e-6,
        "clip.vision.image_size": V_IMAGE_SIZE,
        "clip.vision.patch_size": V_PATCH,
        "clip.vision.image_mean": [0.5, 0.5, 0.5],
        "clip.vision.image_std": [0.5, 0.5, 0.5],
    }


def _mmproj_mlp(path: Path, seed: int, n_embd: int = N_EMBD) -> None:
    """LLaVA-style: CLIP ViT + mm.0/mm.2; one row per patch (16 for 32x32, patch 8).

    The llava graph runs layers up to the second-to-last, so two layers run one.
    """
    w = _Weights(seed, path.name)
    n_layer = 2
    n_patches = (V_IMAGE_SIZE // V_PATCH) ** 2
    tensors = {
        "v.patch_embd.weight": w.normal(V_EMBD, 3, V_PATCH, V_PATCH, scale=0.1),
        "v.patch_embd.bias": w.zeros(V_EMBD),
        "v.position_embd.weight": w.normal(n_patches, V_EMBD, scale=0.1),
    }
    for il in range(n_layer):
        tensors.update(_vision_layer(w, il))
    tensors.update({
        "mm.0.weight": w.normal(MM_HIDDEN, V_EMBD, scale=0.2),
        "mm.0.bias": w.zeros(MM_HIDDEN),
        "mm.2.weight": w.normal(n_embd, MM_HIDDEN, scale=0.2),
        "mm.2.bias": w.zeros(n_embd),
    })
    _write_gguf(path, "clip", _clip_kv("mlp", n_layer, n_embd), tensors)


def _mmproj_qwen2vl(path: Path, seed: int, n_embd: int = N_EMBD) -> None:
    """tools/mtmd/models/qwen2vl.cpp: two patch convs (temporal pair), 2x2 merge, M-RoPE vision."""
    w = _Weights(seed, path.name)
    n_layer = 1
    tensors = {
        "v.patch_embd.weight": w.normal(V_EMBD, 3, V_PATCH, V_PATCH, scale=0.1),
        "v.patch_embd.weight.1": w.normal(V_EMBD, 3, V_PATCH, V_PATCH, scale=0.1),
    }
    for il in range(n_layer):
        tensors.update(_vision_layer(w, il))
    tensors.update({
        "v.post_ln.weight": w.ones(V_EMBD),
        "v.post_ln.bias": w.zeros(V_EMBD),
        "mm.0.weight": w.normal(MM_HIDDEN, 4 * V_EMBD, scale=0.2),
        "mm.0.bias": w.zeros(MM_HIDDEN),
        "mm.2.weight": w.normal(n_embd, MM_HIDDEN, scale=0.2),
        "mm.2.bias": w.zeros(n_embd),
    })
    kv = _clip_kv("qwen2vl_merger", n_layer, n_embd) | {"clip.vision.spatial_merge_size": 2}
    _write_gguf(path, "clip", kv, tensors)


# --- images ---------------------------------------------------------------------

def write_png(path: Path, width: int, height: int, rgb: bytes) -> None:
    """Write an 8-bit RGB PNG with the standard library only (no Pillow needed)."""
    assert len(rgb) == width * height * 3
    raw = b"".join(b"\x00" + rgb[y * width * 3:(y + 1) * width * 3] for y in range(height))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")
    path.write_bytes(png)


def _test_image(path: Path, seed: int, width: int, height: int) -> None:
    w = _Weights(seed, path.name)
    y, x = np.mgrid[0:height, 0:width]
    noise = w.rng.integers(0, 32, size=(height, width, 3))
    rgb = np.stack([x * 255 // max(width - 1, 1), y * 255 // max(height - 1, 1), (x + y) * 4 % 256], axis=-1)
    write_png(path, width, height, np.clip(rgb + noise, 0, 255).astype(np.uint8).tobytes())


# --- public API -------------------------------------------------------------------

def _image_names() -> list[str]:
    return [f"image-{label}-{width}x{height}.png" for label, (width, height) in IMAGES.items()]


def _indexed_files(out: Path) -> set[str]:
    """The files a fixtures dir from before the ownership marker holds of dfbuild's: its index lists them."""
    index = json.loads((out / INDEX_NAME).read_text(encoding="utf-8"))
    return {INDEX_NAME, *index["files"], *(Path(p).name for p in index["images"].values())}


def _write_images(out: Path, seed: int) -> dict[str, str]:
    images = {}
    for label, (width, height) in IMAGES.items():
        path = out / f"image-{label}-{width}x{height}.png"
        _test_image(path, seed, width, height)
        images[label] = str(path)
    return images


def files_intact(section: dict) -> bool:
    """Every file a fixtures index lists is there with the content it recorded."""
    return all(Path(f["path"]).is_file() and sha256_file(Path(f["path"])) == f["sha256"]
               for f in section["files"].values())


def _set_entry(out: Path, fixture_set: FixtureSet) -> dict:
    """One set as the index lists it: its files in OUT and what a smoke run should expect."""
    return {
        "target": str(out / fixture_set.target),
        "mmproj": str(out / fixture_set.mmproj),
        "draft": str(out / fixture_set.draft),
        "arch": fixture_set.arch,
        "projector": fixture_set.projector,
        "draft_rope": fixture_set.draft_rope,
        "agree": fixture_set.agree,
        "expected_acceptance": fixture_set.expected_acceptance(),
        "reproduces_bug": fixture_set.reproduces_bug,
    }


def write_fixtures(out: Path, seed: int = 0) -> dict:
    """Write every fixture file and test image into `out`; return the fixtures section.

    Deterministic: the same seed gives byte-identical files. Also writes
    `fixtures.json` (the returned section) so `dfbuild smoke --fixtures DIR` can find them.
    """
    out = Path(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        # only over files dfbuild wrote here: a user's file of the same name is refused, not replaced
        owned.claim(out, [*FILES.values(), *_image_names(), INDEX_NAME], errors.FixtureError, legacy=_indexed_files)
        _llama_target(out / FILES["llama-random"], seed, agree=False)
        _llama_target(out / FILES["llama-agree"], seed, agree=True)
        _qwen35_target(out / FILES["qwen35-random"], seed, agree=False)
        _qwen35_target(out / FILES["qwen35-agree"], seed, agree=True)
        _mmproj_mlp(out / FILES["mmproj-mlp"], seed)
        _mmproj_qwen2vl(out / FILES["mmproj-grid"], seed)
        _dflash_draft(out / FILES["draft-random"], seed, "random", rope_sections=False)
        for rope in ("plain", "sections"):
            for flavour in ("agree", "disagree"):
                _dflash_draft(out / FILES[f"draft-{rope}-{flavour}"], seed, flavour, rope_sections=rope == "sections")
        images = _write_images(out, seed)
    except OSError as exc:
        raise errors.FixtureError(f"cannot write fixtures to {out}: {exc}", hint="check the directory is writable") from exc

    section = {
        "schema": FIXTURES_SCHEMA,
        "dir": str(out),
        "seed": seed,
        "agree_letter": AGREE_LETTER,
        "images": images,
        "files": {name: {"path": str(out / name), "sha256": sha256_file(out / name)} for name in sorted(FILES.values())},
        "sets": {s.name: _set_entry(out, s) for s in FIXTURE_SETS.values()},
    }
    state.atomic_write_text(out / INDEX_NAME, json.dumps(section, indent=2, sort_keys=True) + "\n")
    return section


# A target of about 160 M parameters (F16, ~320 MB): large enough that decoding, not
# HTTP or the tiny vision tower, dominates a request, small enough that 2 CPU cores
# generate a few tokens a second. Real Qwen3.5 proportions: 3 gated-delta-net layers
# per attention layer, 128-wide heads, GQA 4:1, v heads twice the k heads.
BENCH_SHAPE = Shape(n_embd=1024, n_head=8, n_head_kv=2, head_dim=128, n_ff=3072, n_layer=12,
                    full_attention_interval=4, rope_sections=(24, 24, 16, 0), ssm_state=128, ssm_groups=4,
                    ssm_dt_rank=8, draft_layers=1, draft_block_size=16, draft_target_layers=(1, 6, 10), dtype="f16")
BENCH_SETS = ("qwen35-grid-plain-agree", "qwen35-mlp-plain-agree")


def check_shape(shape: Shape) -> None:
    """Refuse shapes llama.cpp would reject at load time, with the reason in words."""
    problems = []
    if 2 * sum(shape.rope_sections) != shape.head_dim:
        problems.append(f"rope_sections {list(shape.rope_sections)} must sum to head_dim/2 = {shape.head_dim // 2}")
    if shape.ssm_dt_rank % shape.ssm_groups:
        problems.append("ssm_dt_rank (v heads) must be a multiple of ssm_groups (k heads)")
    if shape.n_head % shape.n_head_kv:
        problems.append("n_head must be a multiple of n_head_kv")
    if not all(0 <= layer < shape.n_layer for layer in shape.draft_target_layers):
        problems.append(f"draft_target_layers {list(shape.draft_target_layers)} must lie in 0..{shape.n_layer - 1}")
    if shape.dtype not in ("f32", "f16"):
        problems.append(f"dtype {shape.dtype!r} is neither f32 nor f16")
    if problems:
        raise errors.FixtureError("invalid fixture shape: " + "; ".join(problems), hint="fix the Shape you passed")


def write_bench_fixtures(out: Path, *, shape: Shape = BENCH_SHAPE, seed: int = 0) -> dict:
    """Write a larger agree qwen35 set for benchmarks into `out`; return its section.

    Only what the speculative benchmark loads: the qwen35 agree target at `shape`,
    both projectors (output width = the target's), the plain-rope agreeing DFlash
    draft, and the test images. The section has the layout of `write_fixtures`
    (sets `BENCH_SETS`), plus the shape and the target's parameter count.
    """
    check_shape(shape)
    out = Path(out)
    names = [FILES["qwen35-agree"], FILES["mmproj-mlp"], FILES["mmproj-grid"], FILES["draft-plain-agree"]]
    try:
        out.mkdir(parents=True, exist_ok=True)
        _qwen35_target(out / FILES["qwen35-agree"], seed, agree=True, shape=shape)
        _mmproj_mlp(out / FILES["mmproj-mlp"], seed, shape.n_embd)
        _mmproj_qwen2vl(out / FILES["mmproj-grid"], seed, shape.n_embd)
        _dflash_draft(out / FILES["draft-plain-agree"], seed, "agree", rope_sections=False, shape=shape)
        images = _write_images(out, seed)
    except OSError as exc:
        raise errors.FixtureError(f"cannot write fixtures to {out}: {exc}", hint="check the directory is writable") from exc

    sets = [FIXTURE_SETS[name] for name in BENCH_SETS]
    section = {
        "schema": FIXTURES_SCHEMA,
        "dir": str(out),
        "seed": seed,
        "agree_letter": AGREE_LETTER,
        "images": images,
        "shape": shape.to_dict(),
        "target_params": shape.target_params(),
        "files": {name: {"path": str(out / name), "sha256": sha256_file(out / name)} for name in sorted(names)},
        "sets": {s.name: _set_entry(out, s) for s in sets},
    }
    (out / INDEX_NAME).write_text(json.dumps(section, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return section


def load_fixtures(directory: Path) -> dict:
    """Read the section `write_fixtures` left in `directory`."""
    index = Path(directory) / INDEX_NAME
    if not index.is_file():
        raise errors.FixtureError(f"no {INDEX_NAME} in {directory}", hint=f"run `dfbuild fixtures --out {directory}` first")
    section = json.loads(index.read_text(encoding="utf-8"))
    if section.get("schema") != FIXTURES_SCHEMA:
        raise errors.FixtureError(f"{index} was written by another dfbuild version",
                                  hint=f"rerun `dfbuild fixtures --out {directory}`")
    return section


def ensure_fixtures(directory: Path, seed: int = 0) -> dict:
    """Reuse the fixtures in `directory` when they are complete and current, else (re)write them."""
    try:
        section = load_fixtures(directory)
    except errors.FixtureError:
        return write_fixtures(directory, seed)
    intact = section.get("seed") == seed and files_intact(section)
    return section if intact else write_fixtures(directory, seed)
