// dfbuild's reproducer of a real draft-cache miss (issue 29): written for dfbuild, compiled
// against a built llama.cpp tree (its common/ and include/ headers, its libllama-common and
// libllama), never shipped. Build it into the build's bin/ (a copy of it): a GGML_BACKEND_DL
// build loads its CPU backends from the program's own folder.
//
// It feeds a prompt to the target in n_ubatch pieces the way llama-server's prefill does, hands
// each piece to common_speculative_process() except the ones --miss names, then calls
// common_speculative_begin() with the prompt, as the server does once the prompt is done.
// begin() warns when the draft cache ends before the prompt does: the pieces process() never
// saw. What it prints is upstream's own log line; this program only makes the case happen.
//
//   begin_real_miss --miss none|last|middle -m TARGET -md DRAFT --spec-type draft-dflash
//                   -p PROMPT -ub 8 -b 8 [other common arguments]
//
// stdout, one line: "pieces=P missed=M n_prompt=N draft_pos_max=X"; the log goes to stderr.
// Exit 0 when every call returned; 2 when process() refused a piece (printed, not hidden).

#include "arg.h"
#include "common.h"
#include "llama.h"
#include "ggml-backend.h"
#include "log.h"
#include "speculative.h"

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

int main(int argc, char ** argv) {
    // our one flag, taken out before the common parser sees the rest
    std::string miss = "none";
    std::vector<char *> rest;
    for (int i = 0; i < argc; ++i) {
        if (std::strcmp(argv[i], "--miss") == 0 && i + 1 < argc) {
            miss = argv[++i];
            continue;
        }
        rest.push_back(argv[i]);
    }
    if (miss != "none" && miss != "last" && miss != "middle") {
        std::fprintf(stderr, "--miss takes none, last or middle, not %s\n", miss.c_str());
        return 1;
    }

    common_params params;
    common_init();
    if (!common_params_parse((int) rest.size(), rest.data(), params, LLAMA_EXAMPLE_SPECULATIVE)) {
        return 1;
    }

    ggml_backend_load_all(); // a GGML_BACKEND_DL build keeps its CPU backends beside this program
    llama_backend_init();
    auto init_tgt = common_init_from_params(params);
    llama_model   * model_tgt = init_tgt->model();
    llama_context * ctx_tgt   = init_tgt->context();
    if (model_tgt == nullptr || ctx_tgt == nullptr) {
        std::fprintf(stderr, "the target did not load\n");
        return 1;
    }

    common_params params_dft = common_base_params_to_speculative(params);
    auto init_dft = common_speculative_init_from_params(params_dft, model_tgt, ctx_tgt);
    params.speculative.draft.ctx_tgt = ctx_tgt;
    params.speculative.draft.ctx_dft = init_dft->context();
    llama_context * ctx_dft = params.speculative.draft.ctx_dft;
    if (ctx_dft == nullptr) {
        std::fprintf(stderr, "the draft did not load\n");
        return 1;
    }

    common_speculative * spec = common_speculative_init(params.speculative, 1);
    if (spec == nullptr) {
        std::fprintf(stderr, "no speculative implementation\n");
        return 1;
    }

    const llama_seq_id seq  = 0;
    const llama_tokens prompt = common_tokenize(ctx_tgt, params.prompt, true, true);
    const int32_t      n_ub = (int32_t) llama_n_ubatch(ctx_tgt);
    const int32_t      n_pieces = ((int32_t) prompt.size() + n_ub - 1) / n_ub;
    if (n_pieces < 3) {
        std::fprintf(stderr, "the prompt (%zu tokens) needs at least 3 pieces of %d\n", prompt.size(), n_ub);
        return 1;
    }
    const int32_t skipped = miss == "last" ? n_pieces - 1 : miss == "middle" ? n_pieces / 2 : -1;

    int rc = 0;
    for (int32_t k = 0; k < n_pieces && rc == 0; ++k) {
        common_batch piece(ctx_tgt);
        const int32_t beg = k * n_ub;
        const int32_t end = std::min((int32_t) prompt.size(), beg + n_ub);
        for (int32_t i = beg; i < end; ++i) {
            piece.add(prompt[i], i, seq, i + 1 == (int32_t) prompt.size());
        }
        if (llama_process(ctx_tgt, LLAMA_PROCESS_TYPE_DECODE, piece.get()) != 0) {
            std::fprintf(stderr, "the target refused piece %d\n", k);
            return 1;
        }
        if (k == skipped) {
            continue; // the target has it; the draft never hears of it
        }
        if (!common_speculative_process(spec, piece)) {
            std::fprintf(stderr, "process() refused piece %d\n", k);
            rc = 2;
        }
    }

    common_speculative_begin(spec, seq, prompt);
    common_log_flush(common_log_main()); // the log has a worker thread: its lines before ours, all of them

    const llama_pos pos_max = llama_memory_seq_pos_max(llama_get_memory(ctx_dft), seq);
    std::printf("pieces=%d missed=%d n_prompt=%zu draft_pos_max=%d\n", n_pieces, skipped < 0 ? 0 : 1,
                prompt.size(), (int) pos_max);

    common_speculative_free(spec);
    llama_backend_free();
    return rc;
}
