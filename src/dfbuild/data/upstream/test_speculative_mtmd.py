import os
import sys
from pathlib import Path

import numpy as np
from utils import *

if "NO_LOCAL_GGUF" not in os.environ:
    sys.path.insert(1, str(Path(__file__).resolve().parents[4] / "gguf-py"))
import gguf  # noqa: E402

# DFlash with a draft without rope sections (plain rope) after an image on an M-RoPE target.
# mtmd puts all rows of the image on one position, so the text after it does not continue the draft KV cache.
# The models are tiny and random, written with gguf-py: nothing to download.

server: ServerProcess

# an M-RoPE target whose graph exports the layer inputs that DFlash reads
TARGET_ARCH = "hunyuan_vl"

# 2x2 RGB PNG
IMAGE = "iVBORw0KGgoAAAANSUhEUgAAAAIAAAACCAIAAAD91JpzAAAAEklEQVR42mP4z8DAAMIM/4EAAB/uBfvxq7p3AAAAAElFTkSuQmCC"

N_EMBD, N_HEAD, N_HEAD_KV, HEAD_DIM, N_FF, V_EMBD = 64, 4, 2, 16, 128, 32
SSM_STATE, SSM_GROUPS, SSM_HEADS, SSM_KERNEL = 16, 2, 4, 4

# GPT-2 byte-level BPE over the 256 bytes, so any text tokenizes; token i is byte i
KEEP = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
BYTES = [chr(b) if b in KEEP else chr(0x100 + sum(c not in KEEP for c in range(b))) for b in range(256)]
TOKENS = BYTES + ["<|endoftext|>", "<|mask|>", BYTES[32] * 2]
TOKENIZER = {
    "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "default", "tokenizer.ggml.tokens": TOKENS,
    "tokenizer.ggml.merges": [f"{BYTES[32]} {BYTES[32]}"],
    "tokenizer.ggml.eos_token_id": 256, "tokenizer.ggml.mask_token_id": 257,
}
# the random model may emit any byte: ASCII letters only, so that any response parser takes the text, and no EOS
LETTERS_ONLY = [[i, False] for i, token in enumerate(TOKENS) if not (token.isascii() and token.isalpha())]

# attention and FFN as llama-style layers have them: the hunyuan_vl target's and the DFlash draft's
ATTENTION = {
    "attn_k": (N_HEAD_KV * HEAD_DIM, N_EMBD), "attn_v": (N_HEAD_KV * HEAD_DIM, N_EMBD),
    "attn_output": (N_EMBD, N_HEAD * HEAD_DIM), "attn_q_norm": (HEAD_DIM,), "attn_k_norm": (HEAD_DIM,),
}
FFN = {"ffn_gate": (N_FF, N_EMBD), "ffn_up": (N_FF, N_EMBD), "ffn_down": (N_EMBD, N_FF)}
LAYER = {"attn_norm": (N_EMBD,), "attn_q": (N_HEAD * HEAD_DIM, N_EMBD), **ATTENTION, "ffn_norm": (N_EMBD,), **FFN}
# qwen35's hybrid layers: a gated delta net, then a gated attention layer (its q carries the gate)
CONV_DIM = 2 * SSM_STATE * SSM_GROUPS + SSM_STATE * SSM_HEADS
DELTA_NET = {
    "attn_qkv": (CONV_DIM, N_EMBD), "attn_gate": (SSM_STATE * SSM_HEADS, N_EMBD), "ssm_conv1d": (CONV_DIM, SSM_KERNEL),
    "ssm_dt.bias": (SSM_HEADS,), "ssm_beta": (SSM_HEADS, N_EMBD), "ssm_alpha": (SSM_HEADS, N_EMBD),
    "ssm_norm": (SSM_STATE,), "ssm_out": (N_EMBD, SSM_STATE * SSM_HEADS),
}
GATED_ATTENTION = {"attn_q": (2 * N_HEAD * HEAD_DIM, N_EMBD), **ATTENTION}
QWEN35_LAYERS = [
    {"attn_norm": (N_EMBD,), "post_attention_norm": (N_EMBD,), **mixer, **FFN} for mixer in (DELTA_NET, GATED_ATTENTION)
]
# per target: its layers, its keys, its other tensors, and whether its memory is hybrid (a recurrent state
# cannot be cut back to a shorter prefix, so a prompt that shares a prefix is processed again)
MROPE = {"rope.dimension_sections": [3, 3, 2, 0]}
TARGETS = {
    "hunyuan_vl": ([LAYER, LAYER], MROPE, {}, False),
    "qwen35": (QWEN35_LAYERS, MROPE | {
        "full_attention_interval": 2, "ssm.conv_kernel": SSM_KERNEL, "ssm.inner_size": SSM_STATE * SSM_HEADS,
        "ssm.state_size": SSM_STATE, "ssm.time_step_rank": SSM_HEADS, "ssm.group_count": SSM_GROUPS,
    }, {"blk.0.ssm_a": (SSM_HEADS,)}, True),
}


def write_gguf(path: Path, arch: str, kv: dict, shapes: dict) -> str:
    rng = np.random.default_rng(42)
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in kv.items():
        if isinstance(value, list):
            writer.add_array(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_uint32(key, value)
    for name, shape in shapes.items():
        tensor = rng.standard_normal(shape) * 0.3
        if name.endswith(".ssm_a"):
            tensor = -np.exp(tensor)  # a decaying state
        writer.add_tensor(name, tensor.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def write_text_model(path: Path, arch: str, layers: list[dict], kv: dict, shapes: dict) -> str:
    kv = {"context_length": 4096, "embedding_length": N_EMBD, "block_count": len(layers), "feed_forward_length": N_FF,
          "attention.head_count": N_HEAD, "attention.head_count_kv": N_HEAD_KV, "attention.key_length": HEAD_DIM,
          "attention.value_length": HEAD_DIM, "attention.layer_norm_rms_epsilon": 1e-6,
          "rope.dimension_count": HEAD_DIM, **kv}
    for il, layer in enumerate(layers):
        shapes |= {f"blk.{il}.{name}" + ("" if "." in name else ".weight"): shape for name, shape in layer.items()}
    return write_gguf(path, arch, {f"{arch}.{key}": value for key, value in kv.items()} | TOKENIZER, shapes)


def write_models(out: Path) -> tuple[str, str, str]:
    layers, kv, tensors, _ = TARGETS[TARGET_ARCH]
    target = write_text_model(out / "target.gguf", TARGET_ARCH, layers, kv, {
        "token_embd.weight": (len(TOKENS), N_EMBD), "output_norm.weight": (N_EMBD,), **tensors})
    # a DFlash draft without rope sections (plain rope); it uses the target's embeddings and output
    draft = write_text_model(out / "draft.gguf", "dflash", [LAYER], {"block_size": 4, "target_layers": [0, 1]}, {
        "fc.weight": (N_EMBD, 2 * N_EMBD), "enc.output_norm.weight": (N_EMBD,), "output_norm.weight": (N_EMBD,)})
    # a qwen2vl_merger projector with one vision layer: 2x2 patches merge into one image row
    vision = {name: (V_EMBD,) for name in ("post_ln.weight", "post_ln.bias", "blk.0.ln1.weight", "blk.0.ln2.weight")}
    vision |= {f"blk.0.{name}.bias": (V_EMBD,) for name in ("attn_q", "attn_k", "attn_v", "attn_out", "ln1", "ln2",
                                                            "ffn_down")}
    vision |= {f"blk.0.{name}.weight": (V_EMBD, V_EMBD) for name in ("attn_q", "attn_k", "attn_v", "attn_out")}
    vision |= {"patch_embd.weight": (V_EMBD, 3, 8, 8), "patch_embd.weight.1": (V_EMBD, 3, 8, 8),
               "blk.0.ffn_up.weight": (64, V_EMBD), "blk.0.ffn_up.bias": (64,), "blk.0.ffn_down.weight": (V_EMBD, 64)}
    mmproj = write_gguf(out / "mmproj.gguf", "clip", {
        "clip.projector_type": "qwen2vl_merger", "clip.has_vision_encoder": True,
        "clip.vision.embedding_length": V_EMBD, "clip.vision.feed_forward_length": 64, "clip.vision.block_count": 1,
        "clip.vision.projection_dim": N_EMBD,
        "clip.vision.attention.head_count": 2, "clip.vision.attention.layer_norm_epsilon": 1e-6,
        "clip.vision.image_size": 32, "clip.vision.patch_size": 8, "clip.vision.image_mean": [0.5] * 3,
        "clip.vision.image_std": [0.5] * 3, "clip.vision.spatial_merge_size": 2,
    }, {f"v.{name}": shape for name, shape in vision.items()} | {
        "mm.0.weight": (64, 4 * V_EMBD), "mm.0.bias": (64,), "mm.2.weight": (N_EMBD, 64), "mm.2.bias": (N_EMBD,)})
    return target, draft, mmproj


def test_dflash_plain_rope_draft_after_mrope_image(tmp_path, monkeypatch):
    global server
    target, draft, mmproj = write_models(tmp_path)
    # ServerProcess has no option for a local projector file
    monkeypatch.setenv("LLAMA_ARG_MMPROJ", mmproj)
    monkeypatch.setenv("LLAMA_MEDIA_MARKER", "<__media__>")
    server = ServerProcess()
    server.offline = True
    server.model_hf_repo = None
    server.model_hf_file = None
    server.model_file = target
    server.n_ctx = 1024
    server.n_slots = 1

    def ask(question: str) -> ServerResponse:
        # text before the image, so the draft KV cache is not empty when the gap comes
        return server.make_request("POST", "/completion", data={
            "prompt": {"prompt_string": f"Look: <__media__>{question}", "multimodal_data": [IMAGE]},
            "n_predict": 8,
            "temperature": 0.0,
            "top_k": 1,
            "logit_bias": LETTERS_ONLY,
            "return_tokens": True,
        })

    server.start()
    res = ask(" What is it?")
    assert res.status_code == 200, res.body
    tokens_no_draft = res.body["tokens"]
    server.stop()

    server.model_draft = draft
    server.spec_type = "draft-dflash"
    server.start()
    res = ask(" What is it?")
    assert res.status_code == 200, res.body
    assert res.body["timings"].get("draft_n", 0) > 0, res.body["timings"]
    assert res.body["tokens"] == tokens_no_draft

    # the same image again: only the new question is processed, the prompt before it (the image too) is cached
    res = server.make_request("POST", "/tokenize", data={"content": " Why?"})
    n_question = len(res.body["tokens"])
    res = ask(" Why?")
    assert res.status_code == 200, res.body
    if not TARGETS[TARGET_ARCH][3]:
        assert 0 < res.body["timings"]["prompt_n"] <= n_question, res.body["timings"]
    assert res.body["timings"].get("draft_n", 0) > 0, res.body["timings"]
