import base64
import hashlib
import os
import struct
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
from utils import *

# The models are written at test time by this tree's gguf-py, as the converters write them
if "NO_LOCAL_GGUF" not in os.environ:
    sys.path.insert(1, str(Path(__file__).resolve().parents[4] / "gguf-py"))
import gguf  # noqa: E402

# DFlash speculative decoding after an image, on an M-RoPE target
# (https://github.com/ggml-org/llama.cpp/issues/27408).
#
# mtmd gives every row of an image one temporal position when the decoder uses
# M-RoPE, and a qwen2vl-style merger puts several rows on each position. The draft
# cache must still continue from its last position when the text after the image
# arrives, and the draft block must start where the target's positions are.
#
# Nothing is downloaded: a tiny qwen35 target (gated delta net + attention layers,
# M-RoPE), a qwen2vl_merger projector and a one-layer DFlash draft are written
# below. Every target token embeds to one vector and the output projections are
# zero, so the target always predicts the same letter; the draft uses the target's
# embeddings and head, so its drafts are always accepted. A failed speculative
# batch shows up as an HTTP 500, a missing draft as draft_n_accepted == 0.

server: ServerProcess

N_EMBD = 64
N_HEAD = 4
N_HEAD_KV = 2
HEAD_DIM = 16
N_FF = 128
N_LAYER = 4
FULL_ATTENTION_INTERVAL = 2  # layers 1 and 3 attend, 0 and 2 are gated delta net
ROPE_SECTIONS = [3, 3, 2, 0]
SSM_CONV_KERNEL = 4
SSM_STATE = 16
SSM_GROUPS = 2
SSM_DT_RANK = 4
SSM_INNER = SSM_STATE * SSM_DT_RANK
DRAFT_BLOCK_SIZE = 4
DRAFT_TARGET_LAYERS = [1, 3]
V_EMBD = 32
V_FF = 64
V_PATCH = 8
V_IMAGE_SIZE = 32
MM_HIDDEN = 64
IMAGE_SIZE = 32

# byte-level BPE over the 256 bytes (any text tokenizes), an end and a mask token
EOS_ID = 256
MASK_ID = 257
LETTER = "a"


def byte_tokens() -> list[str]:
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


BYTES = byte_tokens()
SPACE = BYTES[ord(" ")]
TOKENS = BYTES + ["<|endoftext|>", "<|MASK|>", SPACE + SPACE]
N_VOCAB = len(TOKENS)


class Weights:
    def __init__(self, name: str):
        seed = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")
        self.rng = np.random.default_rng(seed)

    def normal(self, *shape: int, scale: float = 0.2) -> np.ndarray:
        return (self.rng.standard_normal(shape) * scale).astype(np.float32)


def ones(*shape: int) -> np.ndarray:
    return np.ones(shape, dtype=np.float32)


def zeros(*shape: int) -> np.ndarray:
    return np.zeros(shape, dtype=np.float32)


def write_gguf(path: Path, arch: str, kv: dict, tensors: dict[str, np.ndarray]) -> None:
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in kv.items():
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_array(key, value)
    for name, data in tensors.items():
        writer.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def text_kv(arch: str, n_layer: int) -> dict:
    return {
        "general.name": f"tiny {arch}",
        f"{arch}.context_length": 4096,
        f"{arch}.embedding_length": N_EMBD,
        f"{arch}.block_count": n_layer,
        f"{arch}.feed_forward_length": N_FF,
        f"{arch}.attention.head_count": N_HEAD,
        f"{arch}.attention.head_count_kv": N_HEAD_KV,
        f"{arch}.attention.key_length": HEAD_DIM,
        f"{arch}.attention.value_length": HEAD_DIM,
        f"{arch}.attention.layer_norm_rms_epsilon": 1e-6,
        f"{arch}.rope.dimension_count": HEAD_DIM,
        f"{arch}.rope.freq_base": 10000.0,
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": TOKENS,
        "tokenizer.ggml.token_type": [1] * 256 + [3, 3, 1],
        "tokenizer.ggml.merges": [f"{SPACE} {SPACE}"],
        "tokenizer.ggml.bos_token_id": EOS_ID,
        "tokenizer.ggml.eos_token_id": EOS_ID,
        "tokenizer.ggml.mask_token_id": MASK_ID,
        "tokenizer.ggml.add_bos_token": False,
    }


def agree_vector() -> np.ndarray:
    v = Weights("agree").rng.standard_normal(N_EMBD).astype(np.float32)
    return v / np.sqrt(np.mean(v * v))  # RMS 1: rms_norm(v) == v


def ffn(w: Weights, p: str) -> dict[str, np.ndarray]:
    return {
        f"{p}.ffn_gate.weight": w.normal(N_FF, N_EMBD, scale=0.02),
        f"{p}.ffn_up.weight": w.normal(N_FF, N_EMBD, scale=0.02),
        f"{p}.ffn_down.weight": zeros(N_EMBD, N_FF),
    }


def write_target(path: Path) -> None:
    w = Weights(path.name)
    v = agree_vector()
    head = w.normal(N_VOCAB, N_EMBD, scale=0.01)
    head[BYTES.index(LETTER)] = v
    tensors = {
        "token_embd.weight": np.tile(v, (N_VOCAB, 1)),
        "output_norm.weight": ones(N_EMBD),
        "output.weight": head,
    }
    q_dim, kv_dim = N_HEAD * HEAD_DIM, N_HEAD_KV * HEAD_DIM
    conv_dim = 2 * SSM_STATE * SSM_GROUPS + SSM_INNER
    for il in range(N_LAYER):
        p = f"blk.{il}"
        tensors[f"{p}.attn_norm.weight"] = ones(N_EMBD)
        tensors[f"{p}.post_attention_norm.weight"] = ones(N_EMBD)
        if (il + 1) % FULL_ATTENTION_INTERVAL == 0:
            tensors.update({
                f"{p}.attn_q.weight": w.normal(2 * q_dim, N_EMBD),  # the query and its output gate
                f"{p}.attn_k.weight": w.normal(kv_dim, N_EMBD),
                f"{p}.attn_v.weight": w.normal(kv_dim, N_EMBD),
                f"{p}.attn_output.weight": zeros(N_EMBD, q_dim),
                f"{p}.attn_q_norm.weight": ones(HEAD_DIM),
                f"{p}.attn_k_norm.weight": ones(HEAD_DIM),
            })
        else:
            tensors.update({
                f"{p}.attn_qkv.weight": w.normal(conv_dim, N_EMBD),
                f"{p}.attn_gate.weight": w.normal(SSM_INNER, N_EMBD),
                f"{p}.ssm_conv1d.weight": w.normal(conv_dim, SSM_CONV_KERNEL),
                f"{p}.ssm_dt.bias": w.normal(SSM_DT_RANK, scale=0.1),
                f"{p}.ssm_a": -np.exp(w.normal(SSM_DT_RANK, scale=0.5)),
                f"{p}.ssm_beta.weight": w.normal(SSM_DT_RANK, N_EMBD),
                f"{p}.ssm_alpha.weight": w.normal(SSM_DT_RANK, N_EMBD),
                f"{p}.ssm_norm.weight": ones(SSM_STATE),
                f"{p}.ssm_out.weight": zeros(N_EMBD, SSM_INNER),
            })
        tensors.update(ffn(w, p))
    kv = text_kv("qwen35", N_LAYER) | {
        "qwen35.rope.dimension_sections": ROPE_SECTIONS,
        "qwen35.full_attention_interval": FULL_ATTENTION_INTERVAL,
        "qwen35.ssm.conv_kernel": SSM_CONV_KERNEL,
        "qwen35.ssm.inner_size": SSM_INNER,
        "qwen35.ssm.state_size": SSM_STATE,
        "qwen35.ssm.time_step_rank": SSM_DT_RANK,
        "qwen35.ssm.group_count": SSM_GROUPS,
    }
    write_gguf(path, "qwen35", kv, tensors)


def write_draft(path: Path, mrope: bool) -> None:
    # no token_embd and no output: the draft uses the target's
    w = Weights(path.name)
    q_dim, kv_dim = N_HEAD * HEAD_DIM, N_HEAD_KV * HEAD_DIM
    tensors = {
        "fc.weight": w.normal(N_EMBD, len(DRAFT_TARGET_LAYERS) * N_EMBD),
        "enc.output_norm.weight": ones(N_EMBD),
        "output_norm.weight": ones(N_EMBD),
        "blk.0.attn_norm.weight": ones(N_EMBD),
        "blk.0.attn_q.weight": w.normal(q_dim, N_EMBD),
        "blk.0.attn_k.weight": w.normal(kv_dim, N_EMBD),
        "blk.0.attn_v.weight": w.normal(kv_dim, N_EMBD),
        "blk.0.attn_output.weight": zeros(N_EMBD, q_dim),
        "blk.0.attn_q_norm.weight": ones(HEAD_DIM),
        "blk.0.attn_k_norm.weight": ones(HEAD_DIM),
        "blk.0.ffn_norm.weight": ones(N_EMBD),
        **ffn(w, "blk.0"),
    }
    kv = text_kv("dflash", 1) | {
        "dflash.block_size": DRAFT_BLOCK_SIZE,
        "dflash.target_layers": DRAFT_TARGET_LAYERS,
    }
    if mrope:
        kv["dflash.rope.dimension_sections"] = [HEAD_DIM // 2, 0, 0, 0]
    write_gguf(path, "dflash", kv, tensors)


def write_mmproj(path: Path) -> None:
    # qwen2vl_merger: two patch convs, one vision layer, a 2x2 merge: several rows per position
    w = Weights(path.name)
    tensors = {
        "v.patch_embd.weight": w.normal(V_EMBD, 3, V_PATCH, V_PATCH, scale=0.1),
        "v.patch_embd.weight.1": w.normal(V_EMBD, 3, V_PATCH, V_PATCH, scale=0.1),
        "v.post_ln.weight": ones(V_EMBD),
        "v.post_ln.bias": zeros(V_EMBD),
        "mm.0.weight": w.normal(MM_HIDDEN, 4 * V_EMBD),
        "mm.0.bias": zeros(MM_HIDDEN),
        "mm.2.weight": w.normal(N_EMBD, MM_HIDDEN),
        "mm.2.bias": zeros(N_EMBD),
    }
    for name in ("attn_q", "attn_k", "attn_v", "attn_out"):
        tensors[f"v.blk.0.{name}.weight"] = w.normal(V_EMBD, V_EMBD)
        tensors[f"v.blk.0.{name}.bias"] = w.normal(V_EMBD, scale=0.02)
    for name in ("ln1", "ln2"):
        tensors[f"v.blk.0.{name}.weight"] = ones(V_EMBD)
        tensors[f"v.blk.0.{name}.bias"] = zeros(V_EMBD)
    tensors.update({
        "v.blk.0.ffn_up.weight": w.normal(V_FF, V_EMBD),
        "v.blk.0.ffn_up.bias": zeros(V_FF),
        "v.blk.0.ffn_down.weight": w.normal(V_EMBD, V_FF),
        "v.blk.0.ffn_down.bias": zeros(V_EMBD),
    })
    kv = {
        "general.name": "tiny qwen2vl_merger",
        "clip.projector_type": "qwen2vl_merger",
        "clip.has_vision_encoder": True,
        "clip.vision.embedding_length": V_EMBD,
        "clip.vision.feed_forward_length": V_FF,
        "clip.vision.block_count": 1,
        "clip.vision.projection_dim": N_EMBD,
        "clip.vision.attention.head_count": 2,
        "clip.vision.attention.layer_norm_epsilon": 1e-6,
        "clip.vision.image_size": V_IMAGE_SIZE,
        "clip.vision.patch_size": V_PATCH,
        "clip.vision.image_mean": [0.5, 0.5, 0.5],
        "clip.vision.image_std": [0.5, 0.5, 0.5],
        "clip.vision.spatial_merge_size": 2,
    }
    write_gguf(path, "clip", kv, tensors)


def png_base64(size: int) -> str:
    # a gradient, written with zlib alone
    rows = b"".join(b"\x00" + b"".join(bytes((x * 8 % 256, y * 8 % 256, (x + y) * 4 % 256)) for x in range(size))
                    for y in range(size))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", size, size, 8, 2, 0, 0, 0))
           + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b""))
    return base64.b64encode(png).decode()


@pytest.fixture(scope="session", autouse=True)
def load_server_presets():
    # overrides conftest.py's for this module: its models are written locally, nothing to download
    pass


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    out = tmp_path_factory.mktemp("dflash-mtmd")
    paths = {name: out / f"{name}.gguf" for name in ("target", "mmproj", "draft", "draft-mrope")}
    write_target(paths["target"])
    write_mmproj(paths["mmproj"])
    write_draft(paths["draft"], mrope=False)
    write_draft(paths["draft-mrope"], mrope=True)
    return {name: str(path) for name, path in paths.items()}


def create_server(models: dict[str, str], draft: str | None):
    global server
    server = ServerProcess()
    server.offline = True
    server.model_hf_repo = None
    server.model_hf_file = None
    server.model_file = models["target"]
    server.model_alias = "tiny-qwen35"
    server.n_ctx = 2048
    server.n_slots = 1
    server.temperature = 0.0
    if draft is not None:
        server.model_draft = models[draft]
        server.spec_type = "draft-dflash"


@pytest.fixture(autouse=True)
def mmproj(models, monkeypatch):
    # ServerProcess has no option for a local projector file: the server reads it from its env
    monkeypatch.setenv("LLAMA_ARG_MMPROJ", models["mmproj"])


IMAGE = png_base64(IMAGE_SIZE)


def image_completion(prompt_after: str) -> ServerResponse:
    marker = server.make_request("GET", "/props").body.get("media_marker", "<__media__>")
    return server.make_request("POST", "/completion", data={
        "prompt": {
            "prompt_string": f"Here is a picture: {marker}{prompt_after}",
            "multimodal_data": [IMAGE],
        },
        "n_predict": 16,
        "temperature": 0.0,
        "top_k": 1,
        "seed": 42,
        "ignore_eos": True,
    })


def image_chat(prompt_after: str) -> ServerResponse:
    return server.make_request("POST", "/chat/completions", data={
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": "Here is a picture:"},
            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{IMAGE}"}},
            {"type": "text", "text": prompt_after},
        ]}],
        "max_tokens": 16,
        "temperature": 0.0,
        "top_k": 1,
        "seed": 42,
    })


def content_of(res: ServerResponse) -> str:
    if "choices" in res.body:
        return res.body["choices"][0]["message"]["content"]
    return res.body["content"]


@pytest.mark.parametrize("draft", ["draft", "draft-mrope"], ids=["plain-rope-draft", "mrope-draft"])
@pytest.mark.parametrize("request_image", [image_completion, image_chat], ids=["completion", "chat"])
def test_dflash_after_image(models, draft, request_image):
    global server
    create_server(models, draft=None)
    server.start()
    res = request_image(" What does it show? Answer in a few words.")
    assert res.status_code == 200, res.body
    expected = content_of(res)
    server.stop()

    create_server(models, draft=draft)
    server.start()
    # text after the image: the draft cache has to continue past the image's positions
    res = request_image(" What does it show? Answer in a few words.")
    assert res.status_code == 200, res.body
    timings = res.body["timings"]  # draft_n is left out when nothing was drafted
    assert timings.get("draft_n", 0) > 0, timings
    assert timings.get("draft_n_accepted", 0) > 0, timings
    assert content_of(res) == expected

    # a second question about the same image reuses the cached image prefix
    res = request_image(" And its colours?")
    assert res.status_code == 200, res.body
    assert res.body["timings"].get("draft_n_accepted", 0) > 0, res.body["timings"]
