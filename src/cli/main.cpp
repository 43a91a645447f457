// k3: the k3cpp command line. `k3 --help` lists the subcommands; each has its own --help.
#include <cstdio>

#include "cli/args.h"
#include "cli/commands.h"
#include "cli/library_env.h"
#include "core/error.h"
#include "dist/group.h"

namespace {

// A failed run ends with one "error:" line and exit status 1. Under mpirun the line names the rank, and the
// whole job is stopped (the other ranks would otherwise wait for this one in their next collective).
int report_error(const char* what) {
  if (k3::dist::launched_by_mpi()) {
    k3::dist::Group& w = k3::dist::world();
    std::fprintf(stderr, "error (rank %d of %d): %s\n", w.rank(), w.size(), what);
    std::fflush(stderr);
    k3::dist::abort_world(1);
  } else {
    std::fprintf(stderr, "error: %s\n", what);
  }
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  k3::cli::reexec_with_library_settings(argc, argv);
  CLI::App app{"k3: Kimi K3 in C++ (inference and training engine)"};
  app.require_subcommand(1);
  k3::cli::register_logits(app);
  k3::cli::register_generate(app);
  k3::cli::register_inspect(app);
  k3::cli::register_init(app);
  k3::cli::register_tokenize(app);
  k3::cli::register_detokenize(app);
  k3::cli::register_tokenizer(app);
  k3::cli::register_chat_template(app);
  k3::cli::register_grad(app);
  k3::cli::register_data(app);
  k3::cli::register_train(app);
  k3::cli::register_sft(app);
  k3::cli::register_rl(app);
  k3::cli::register_distill(app);
  k3::cli::register_rl_tasks(app);
  k3::cli::register_corpus(app);
  k3::cli::register_eval(app);
  k3::cli::register_serve(app);
  k3::cli::register_vision_encode(app);
  k3::cli::add_strict_number_checks(app);
  try {
    k3::cli::apply_gemm_env();  // K3_GEMM=f32|f64: the CPU linears' accumulation (README, "Switches")
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // --help and --version are "errors" that exit 0: CLI11 prints them. A real parse error ends like
    // every other error: one "error:" line and exit status 1.
    if (e.get_exit_code() == 0) return app.exit(e);
    std::fprintf(stderr, "error: %s (see --help)\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    return report_error(e.what());
  }
  return 0;
}
