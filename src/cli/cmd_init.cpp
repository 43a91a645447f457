// k3 init: write a randomly initialised model directory for a config.
#include <cstdio>
#include <memory>

#include "cli/args.h"
#include "cli/commands.h"
#include "model/init_random.h"

namespace k3::cli {

void register_init(CLI::App& app) {
  struct Opts {
    std::string config, out;
    RandomInitOptions init;
  };
  auto o = std::make_shared<Opts>();
  CLI::App* sub = app.add_subcommand(
      "init",
      "Write a randomly initialised K3 model directory (config.json + model.safetensors, release tensor\n"
      "names, BF16 weights) for the shapes of --config, with the vision tower and projector when it has a\n"
      "vision_config. For tests, benchmarks and training from scratch.");
  sub->add_option("--config", o->config, "config.json to take the shapes from (e.g. configs/k3-small.json)")
      ->required();
  sub->add_option("--out", o->out, "output directory (created; files written atomically)")->required();
  sub->add_option("--seed", o->init.seed, "random seed")->capture_default_str();
  sub->add_flag("--mxfp4", o->init.mxfp4_experts, "store routed experts as MXFP4 (as the release does)");
  sub->add_flag("--release-shards", o->init.release_shards,
                "write the release's shard layout (model-000NN-of-000096.safetensors for 93 layers: layer L in "
                "shard L+1, then the globals, projector and vision tower; with model.safetensors.index.json) "
                "instead of one model.safetensors");
  sub->add_flag("--random-attnres", o->init.random_attnres_queries,
                "random AttnRes pseudo-queries instead of the paper's zero init");
  sub->add_option("--router-bias-std", o->init.router_bias_std, "std of a random router e_score_correction_bias")
      ->capture_default_str();
  sub->callback([o] {
    std::fprintf(stderr, "[%.2fs] writing %s from %s\n", elapsed_seconds(), o->out.c_str(), o->config.c_str());
    write_random_model(o->config, o->out, o->init);
    std::fprintf(stderr, "[%.2fs] done\n", elapsed_seconds());
  });
}

}  // namespace k3::cli
