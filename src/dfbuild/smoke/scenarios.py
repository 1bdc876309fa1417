"""The scenario table: the requests (steps) each scenario sends, the fixture sets it runs on, the server's arguments."""

from __future__ import annotations

from dataclasses import dataclass

TEXT_PROMPT = "The quick brown fox jumps over the lazy dog. Once more: the quick brown fox"
N_PREDICT = 16
SEED = 42


@dataclass(frozen=True)
class Step:
    """One /completion request. `text` holds {media} markers, `images` names fixture images."""

    label: str
    text: str
    images: tuple[str, ...] = ()
    stream: bool = False
    parallel_group: int | None = None  # steps with the same group are sent concurrently
    endpoint: str = "/completion"  # or "/v1/embeddings" (the prompt as its input; nothing is generated)

    @property
    def has_image(self) -> bool:
        return bool(self.images)


def _image_prompt(tag: str) -> str:
    # text after the image: a prompt that *ends* with an image aborts upstream
    # servers with GGML_ASSERT(batch.size() > 0), a separate known bug.
    return f"USER: look {tag} {{media}}\nwhat is in the picture? ASSISTANT: it shows"


TEXT = Step("text", TEXT_PROMPT)
TEXT_STREAM = Step("text-stream", TEXT_PROMPT, stream=True)
IMAGE = Step("image", _image_prompt("here"), ("small",))
IMAGE_STREAM = Step("image-stream", _image_prompt("again"), ("small",), stream=True)
TEXT_AFTER = Step("text-after-image", "And now some plain text after that picture, then")
TWO_IMAGES = Step("two-images", "USER: first {media} and second {media}\ncompare them. ASSISTANT: the first",
                  ("small", "large"))
LARGE_IMAGE = Step("large-image", _image_prompt("big"), ("large",))
PREFIX_TEXT_A = Step("prefix-text-a", TEXT_PROMPT)
PREFIX_TEXT_B = Step("prefix-text-b", TEXT_PROMPT + " jumps over the lazy dog again and")
PREFIX_IMAGE_A = Step("prefix-image-a", _image_prompt("cached"), ("small",))
PREFIX_IMAGE_B = Step("prefix-image-b", _image_prompt("cached") + " a small picture of", ("small",))
EMBED_IMAGE = Step("embeddings-image", _image_prompt("embedded"), ("small",), endpoint="/v1/embeddings")

# slot-restore: a prompt the target restores from a file and the draft never processed
# The first release whose llama-server, started with a projector, saves and restores a slot that holds
# no media (the servers of b9837 to b10042 refuse every slot action through check_no_mtmd, read in their
# sdists; b9837's proof saw the HTTP 501).
SLOT_ACTIONS_WITH_PROJECTOR = 10054
SLOT_FILE = "dfbuild-smoke-slot.bin"
RESTORE_PROMPT = " ".join(f"item {i} is a word" for i in range(40))  # about 700 tokens: many ubatches
RESTORE_STEPS = (
    Step("restore-long", RESTORE_PROMPT),
    Step("slot-save", "", endpoint="/slots/0?action=save"),
    Step("slot-erase", "", endpoint="/slots/0?action=erase"),
    Step("restore-other", "short other prompt"),  # the draft cache now holds another prompt's start
    Step("slot-restore", "", endpoint="/slots/0?action=restore"),
    Step("restored-prefix", RESTORE_PROMPT + " and then more words follow"),
)
# the same restore into an erased slot, with no other prompt between: the draft cache is empty when the
# restored prefix is reused, and an empty cache takes any start position (issue 37)
EMPTY_RESTORE_STEPS = tuple(step for step in RESTORE_STEPS if step.label != "restore-other")


@dataclass(frozen=True)
class Scenario:
    name: str
    steps: tuple[Step, ...]
    server_args: tuple[str, ...] = ()
    description: str = ""
    # only on fixture sets whose image rows take one position each (a llama target), where
    # upstream injects them from b10355 on: there no image's span may reach the draft as zero-fill
    linear_images_only: bool = False
    since_build: int | None = None  # the first llama.cpp release it applies to (None: every one)
    projectors: tuple[str, ...] = ()  # only on fixture sets with one of these projectors (empty: every set)
    # a line the speculative server's log must show, or the scenario never reached its case
    expect_log: str | None = None
    archs: tuple[str, ...] = ()  # only on fixture sets whose target has one of these architectures
    slot_save: bool = False  # the server gets a --slot-save-path of its own (the slot actions' folder)
    draft_ropes: tuple[str, ...] = ()  # only on sets whose draft has one of these ropes (plain, sections, fixed)
    # What the unpatched build does here, which a proof holds the patched build to (issue 37):
    # "same": the case works unpatched, so where the unpatched run passes the patched one must give the
    #         same outputs, draft counters and drafted candidates (-v);
    # "fails": the bug's case: the unpatched run fails with the upstream symptom and the patched run
    #          zero-fills the image's span (with a warning, as every fill; run.py judges that).
    unpatched: str = ""

    def applies_to(self, release: int | None) -> bool:
        """Unknown releases (a PR head, an imported tree) run it: better a check too many."""
        return self.since_build is None or release is None or release >= self.since_build

    def runs_on(self, fixture_set: dict) -> bool:
        if self.projectors and fixture_set.get("projector") not in self.projectors:
            return False
        if self.archs and fixture_set.get("arch") not in self.archs:
            return False
        if self.draft_ropes and fixture_set.get("draft_rope") not in self.draft_ropes:
            return False
        return not (self.linear_images_only and fixture_set.get("reproduces_bug", True))


_SEQUENCE = (TEXT, IMAGE, TEXT_AFTER, TWO_IMAGES, PREFIX_IMAGE_A, PREFIX_IMAGE_B)

SCENARIOS = {s.name: s for s in (
    Scenario("text", (TEXT, TEXT_STREAM), description="plain text, plain and streamed"),
    Scenario("image", (IMAGE, IMAGE_STREAM), description="one image, text after it; plain and streamed"),
    Scenario("text-after-image", (IMAGE, TEXT_AFTER), description="a text request after an image request"),
    Scenario("two-images", (TWO_IMAGES,), description="two images in one request"),
    Scenario("large-image", (LARGE_IMAGE, TEXT_AFTER), server_args=("-b", "8", "-ub", "8"),
             description="an image larger than one ubatch (-b 8 -ub 8)"),
    Scenario("prefix-reuse", (PREFIX_TEXT_A, PREFIX_TEXT_B, PREFIX_IMAGE_A, PREFIX_IMAGE_B),
             description="cache_prompt reuses a text prefix, then a prefix that holds an image"),
    Scenario("parallel", (
        Step("parallel-image", _image_prompt("slot"), ("small",), parallel_group=1),
        Step("parallel-text", TEXT_PROMPT, parallel_group=1),
        Step("parallel-image-2", _image_prompt("other"), ("large",), parallel_group=2),
        Step("parallel-image-3", _image_prompt("both"), ("small",), parallel_group=2),
    ), server_args=("-np", "2"), description="-np 2: concurrent image and text requests"),
    Scenario("repeat", _SEQUENCE * 3, description="the whole sequence three times on one server"),
    # -v prints the draft's debug log, where a zero-filled span names its positions. On a
    # target whose image rows take one position each (linear rope) nothing leaves a hole on a
    # fresh server, so any zero-fill there means an image's rows reached the draft as zeros
    # instead of the target's features. Before b10355 upstream's process() leaves every image
    # out of the draft by itself, so the scenario starts there.
    Scenario("linear-image", (IMAGE, TEXT_AFTER, TWO_IMAGES), server_args=("-v",),
             description="images with linear positions reach the draft with the target's features (no zero-fill)",
             linear_images_only=True, since_build=10355, unpatched="same"),
    # The cases the series must leave as upstream runs them (issue 37), each at -v so the proof can
    # compare what the draft proposed, not only the counters. An M-RoPE draft (rope sections) may jump
    # over an image's span (X < Y): no fill, from b10662 on, where DFlash drafts honour their sections.
    Scenario("mrope-draft", (IMAGE, TEXT_AFTER, TWO_IMAGES), server_args=("-v",),
             description="an M-RoPE draft jumps over an image's span, as unpatched (no zero-fill)",
             archs=("qwen35",), draft_ropes=("sections",), since_build=10662, unpatched="same"),
    # An empty draft cache takes any start position: no fill either. A slot restored into an erased slot
    # makes one: the target reuses ~700 restored tokens, the draft holds none, so its first batch starts
    # far past position 0. (A prompt that opens with an image does not: mtmd puts the projector's text
    # markers before the image.) The llama sets only, as slot-restore: the hybrid qwen35 target processes a
    # restored prompt again. From b10054: before it a server with a projector refuses every slot action
    # (check_no_mtmd: HTTP 501 "not supported by multimodal"); from b10054 only a slot that holds media
    # (check_slot_no_media), and these slots hold text.
    Scenario("empty-draft-cache", EMPTY_RESTORE_STEPS, server_args=("-v",),
             description="a slot restored into an erased slot: an empty draft cache meets a batch far past 0",
             archs=("llama",), slot_save=True, expect_log=r"cached n_tokens = [1-9]\d*, memory_seq_rm",
             since_build=SLOT_ACTIONS_WITH_PROJECTOR, unpatched="same"),
    # The bug's own case: a plain-rope draft, a cache that holds the text before a pinned image, the text
    # after it. Unpatched it fails; patched the image's span is zero-filled, with a warning.
    Scenario("pinned-image-hole", (IMAGE, TEXT_AFTER), server_args=("-v",),
             description="the bug: a plain-rope draft's cache gets a hole from a left-out pinned image",
             archs=("qwen35",), draft_ropes=("plain",), unpatched="fails"),
    # Issue 43's way out without the series: the bug's request with the plain-rope draft after `dfbuild draft
    # fix` (its tensors, byte for byte, plus dflash.rope.dimension_sections). From b10662 on the loader makes it an
    # M-RoPE draft, which jumps over the image's span: it passes unpatched, with no fill. Before b10662 the
    # loader ignores the key, so the unpatched build fails as with the plain draft (and the series fills there).
    Scenario("fixed-draft", (IMAGE, TEXT_AFTER), server_args=("-v",),
             description="the bug's request with a draft fixed by `dfbuild draft fix`: unpatched passes from b10662",
             archs=("qwen35",), draft_ropes=("fixed",), unpatched="same"),
    # The two edge cases of embedding-skip's test (issue 29). It compares the first and last row
    # of each batch process() sees, and mtmd hands it the image in n_batch pieces: the grid
    # projector's small image is 9 rows on one temporal position, so -b 8 gives a last piece of
    # ONE row, which no first/last test can tell from a text token: it is injected at the pinned
    # position after its 8 siblings were skipped. -v: mtmd logs its pieces only at -v.
    Scenario("single-row-chunk", (IMAGE, TEXT_AFTER), server_args=("-b", "8", "-ub", "8", "-v"),
             description="an M-RoPE image whose last -b 8 piece holds one row (injected; its siblings skipped)",
             projectors=("qwen2vl_merger",), expect_log=r"n_tokens_batch = 1\b"),
    # process() reads a batch's kind from its first entry (common_batch::has_token/has_embd). The
    # server builds one batch of text tokens and image rows only for an embeddings task on a
    # target without causal attention (server_context::use_mixed_batch, add_prompt_mixed), and
    # hands it to process() when a draft is loaded. llama-server has no --attention flag: the
    # target's own GGUF key says non-causal.
    Scenario("mixed-batch", (EMBED_IMAGE,),
             server_args=("--embeddings", "--pooling", "mean", "--override-kv", "qwen35.attention.causal=bool:false"),
             description="one batch of text tokens and image rows (embeddings, non-causal target) reaches the draft",
             projectors=("qwen2vl_merger",)),
    # A prompt prefix the draft never processed (issue 29's "real miss"). llama-server's slot
    # restore (POST /slots/0?action=restore) loads the target's cache from a file and leaves the
    # draft's as it was: here holding the start of another prompt, so the next request reuses a
    # restored prefix of ~700 tokens the draft never saw and its first batch starts past the
    # draft's last position. A text-only case: it needs a target that reuses a partial prefix
    # (a llama target; the hybrid qwen35 re-processes the whole prompt after a restore, so no
    # hole opens there). -v: the server's "cached n_tokens" line shows the restored prefix was
    # reused (the case), and the draft's zero-fill line what the series did about it.
    Scenario("slot-restore", RESTORE_STEPS, server_args=("-v",),
             description="a slot restored from a file: the target reuses a prefix the draft never processed",
             archs=("llama",), slot_save=True, expect_log=r"cached n_tokens = [1-9]\d*, memory_seq_rm",
             since_build=SLOT_ACTIONS_WITH_PROJECTOR),
)}

# the edge cases run when asked for (--scenario), not in every proof and release
EDGE_SCENARIOS = ("single-row-chunk", "mixed-batch", "slot-restore")
UNPATCHED_EXPECTATIONS = ("", "same", "fails")
DEFAULT_SCENARIOS = tuple(name for name in SCENARIOS if name not in EDGE_SCENARIOS)
# The control, then the shapes of the bug: both projectors with the plain-rope draft
# (fails on b10359 and b11312), and the rope-sections draft that b11312 honours.
# The random sets check greedy equality where the output is not one repeated letter, and
# draft what their cache makes them draft: a patched build that changed what an M-RoPE
# draft or an empty draft cache holds would change their drafted candidates (issue 37).
DEFAULT_SETS = ("llama-mlp-agree", "qwen35-mlp-plain-agree", "qwen35-grid-plain-agree", "qwen35-grid-sections-agree",
                "qwen35-grid-plain-random", "qwen35-grid-sections-random", "llama-mlp-random")


def base_server_args(fixture_set: dict, *, speculative: bool) -> list[str]:
    """One thread: the models are tiny, and ggml's spinning workers on a busy machine
    (2 cores, a build next door) turned 15 s runs into 5 minutes with -t 2."""
    args = ["-m", fixture_set["target"], "--mmproj", fixture_set["mmproj"],
            "-c", "2048", "-np", "1", "-t", "1", "--metrics", "--no-webui"]
    if speculative:
        args += ["-md", fixture_set["draft"], "--spec-type", "draft-dflash"]
    else:
        args += ["--spec-type", "none"]
    return args


def _merge_args(base: list[str], extra: tuple[str, ...] | list[str]) -> list[str]:
    """Later flags win: drop a base flag (and its value) that `extra` sets again."""
    extra = list(extra)
    overridden = {a for a in extra if a.startswith("-")}
    merged, skip = [], False
    for i, arg in enumerate(base):
        if skip:
            skip = False
            continue
        if arg in overridden:
            skip = i + 1 < len(base) and not base[i + 1].startswith("-")
            continue
        merged.append(arg)
    return merged + extra
