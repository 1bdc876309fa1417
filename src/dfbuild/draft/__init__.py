"""dfbuild.draft: a user's DFlash draft and its target (issue 43), read and fixed without a patched build.

`header` reads a GGUF file's header strictly over a memory map (keys, tensor infos, each key's byte range);
`check` says whether a draft and its target hit llama.cpp #27408, on which releases, and the way out;
`fix` writes the draft again with `dflash.rope.dimension_sections` (streamed, read back, renamed in).
It needs core and gguf only.
"""
