// Each `k3` subcommand lives in its own cmd_<name>.cpp and registers itself on the CLI11 app.
// A registered callback runs the command and throws k3::Error on bad input; main() prints it.
#pragma once
#include <CLI/CLI.hpp>

namespace k3::cli {

void register_logits(CLI::App& app);
void register_generate(CLI::App& app);
void register_inspect(CLI::App& app);
void register_init(CLI::App& app);
void register_tokenize(CLI::App& app);
void register_detokenize(CLI::App& app);
void register_tokenizer(CLI::App& app);
void register_chat_template(CLI::App& app);
void register_grad(CLI::App& app);
void register_data(CLI::App& app);
void register_train(CLI::App& app);
void register_sft(CLI::App& app);
void register_rl(CLI::App& app);
void register_distill(CLI::App& app);
void register_rl_tasks(CLI::App& app);
void register_corpus(CLI::App& app);
void register_eval(CLI::App& app);
void register_serve(CLI::App& app);
void register_vision_encode(CLI::App& app);

}  // namespace k3::cli
