// k3 generate: prefill a prompt of token ids, then decode new tokens one at a time from the cache.
#include <cstdio>
#include <memory>

#include "cli/args.h"
#include "cli/commands.h"
#include "core/error.h"
#include "model/generate.h"

namespace k3::cli {

void register_generate(CLI::App& app) {
  struct Opts {
    std::string model = "tests/fixtures/k3-tiny-a";
    std::string ids = "203,802,2,239,451,327,163,54";
    int64_t max_new = 24;
    bool greedy = false, print_ids = false;
    float temperature = 1.0f, top_p = 1.0f;
    int64_t top_k = 0;
    uint64_t seed = 0;
  };
  auto o = std::make_shared<Opts>();
  CLI::App* sub = app.add_subcommand(
      "generate",
      "Generate token ids after a prompt of token ids (incremental decoding: the KDA state and the MLA\n"
      "latent cache carry the prefix). Reads MODEL/config.json and its safetensors. Stops after\n"
      "--max-new-tokens or on the config's eos_token_id. Sampling is greedy unless --temperature,\n"
      "--top-k or --top-p is given. Prints a report and the ids; with --print-ids the last line of\n"
      "stdout is the generated ids separated by spaces.");
  sub->add_option("--model", o->model, "model directory (config.json + model.safetensors or shards)")->capture_default_str();
  sub->add_option("--ids", o->ids, "prompt: comma-separated token ids")->capture_default_str();
  sub->add_option("--max-new-tokens", o->max_new, "tokens to generate at most")->capture_default_str();
  auto* greedy = sub->add_flag("--greedy", o->greedy, "pick the most likely token (the default)");
  auto* temp = sub->add_option("--temperature", o->temperature, "sampling temperature (> 0)");
  auto* topk = sub->add_option("--top-k", o->top_k, "sample among the K most likely tokens (0: all)");
  auto* topp = sub->add_option("--top-p", o->top_p, "sample from the smallest set with this probability mass, in (0, 1]");
  sub->add_option("--seed", o->seed, "random seed for sampling")->capture_default_str();
  sub->add_flag("--print-ids", o->print_ids, "print only the generated ids (the last line of stdout)");
  greedy->excludes(temp)->excludes(topk)->excludes(topp);
  sub->callback([o, temp, topk, topp] {
    const std::vector<int32_t> prompt = parse_ids(o->ids, "--ids");
    if (o->max_new < 0) fail("--max-new-tokens must be >= 0, got ", o->max_new);
    SamplingParams sp;
    sp.greedy = !(temp->count() || topk->count() || topp->count());
    sp.temperature = o->temperature;
    sp.top_k = o->top_k;
    sp.top_p = o->top_p;
    sp.seed = o->seed;
    Sampler sampler(sp);
    std::fprintf(stderr, "[%.2fs] loading %s\n", elapsed_seconds(), o->model.c_str());
    auto m = Model::load(o->model);
    check_ids_in_vocab({prompt}, m->config().vocab_size, "--ids", m->config().source);
    GenerateResult r = generate(*m, prompt, o->max_new, sampler);
    std::string ids;
    for (size_t i = 0; i < r.tokens.size(); ++i) ids += (i ? " " : "") + std::to_string(r.tokens[i]);
    if (!o->print_ids) {
      const double n = double(r.tokens.size());
      std::printf("prompt: %zu tokens, prefill %.3f s (%.1f tok/s)\n", prompt.size(), r.prefill_seconds,
                  double(prompt.size()) / std::max(r.prefill_seconds, 1e-9));
      std::printf("generated: %zu tokens, decode %.3f s (%.1f tok/s), stopped on %s\n", r.tokens.size(),
                  r.decode_seconds, n > 1 ? (n - 1) / std::max(r.decode_seconds, 1e-9) : 0.0,
                  r.stopped_on_eos ? "eos" : "max-new-tokens");
      std::printf("ids: %s\n", ids.c_str());
    } else {
      std::printf("%s\n", ids.c_str());
    }
  });
}

}  // namespace k3::cli
