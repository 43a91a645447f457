// k3: the k3cpp command line. `k3 --help` lists the subcommands; each has its own --help.
#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <string>

#include "cli/args.h"
#include "cli/commands.h"
#include "cli/library_env.h"
#include "core/error.h"
#include "dist/group.h"

namespace {

int g_error_fd = -1;  // ranks other than 0: their own stderr, kept for the error line

// A failed run ends with one "error:" line and exit status 1. Under mpirun the line names the rank, and the
// whole job is stopped (the other ranks would otherwise wait for this one in their next collective).
int report_error(const char* what) {
  if (k3::dist::launched_by_mpi()) {
    k3::dist::Group& w = k3::dist::world();
    const std::string line =
        "error (rank " + std::to_string(w.rank()) + " of " + std::to_string(w.size()) + "): " + what + "\n";
    std::fflush(stderr);
    if (::write(g_error_fd >= 0 ? g_error_fd : 2, line.data(), line.size()) < 0) std::perror("k3");
    k3::dist::abort_world(1);
  } else {
    std::fprintf(stderr, "error: %s\n", what);
  }
  return 1;
}

// Under mpirun with more than one rank: the commands that run as one job over the ranks (train and sft
// data-parallel, logits and generate expert-parallel) are let through, and ranks other than 0 print nothing on
// stdout or stderr (rank 0 answers for the job; an error still names its rank). Any other command is refused by name: run on its own, each rank would
// do the whole work again or contend for the same files and ports.
std::string check_ranks(int argc, char** argv) {
  if (!k3::dist::launched_by_mpi() || k3::dist::world().size() == 1) return "";
  const std::string cmd = argc > 1 ? argv[1] : "";
  if (cmd == "--help" || cmd == "-h") return "";
  if (cmd != "train" && cmd != "sft" && cmd != "logits" && cmd != "generate")
    return "k3 " + cmd +
           " runs on one process; under mpirun: train and sft (data-parallel), logits and generate "
           "(expert-parallel)";
  // Every rank must run the same command: the collectives of ranks given other flags or inputs would not match.
  std::string line;
  for (int i = 1; i < argc; ++i) line.append(argv[i]).push_back('\0');
  k3::dist::check_same_on_every_rank(k3::dist::world(), line, "the command line");
  if (k3::dist::world().rank() != 0) {
    std::fflush(nullptr);
    g_error_fd = ::dup(2);
    const int null = ::open("/dev/null", O_WRONLY);
    if (g_error_fd < 0 || null < 0 || ::dup2(null, 1) < 0 || ::dup2(null, 2) < 0)
      return "cannot quiet the output of rank " + std::to_string(k3::dist::world().rank());
    ::close(null);
  }
  return "";
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
    if (const std::string bad = check_ranks(argc, argv); !bad.empty()) return report_error(bad.c_str());
    k3::cli::apply_gemm_env();  // K3_GEMM=f32|f64: the CPU linears' accumulation (README, "Switches")
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // --help and --version are "errors" that exit 0: CLI11 prints them. A real parse error ends like
    // every other error: one "error:" line and exit status 1.
    if (e.get_exit_code() == 0) return app.exit(e);
    return report_error((std::string(e.what()) + " (see --help)").c_str());
  } catch (const std::exception& e) {
    return report_error(e.what());
  }
  return 0;
}
