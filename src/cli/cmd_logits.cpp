// k3 logits: full-sequence forward of one or more rows of token ids; writes the logits.
#include <cstdio>
#include <memory>

#include "cli/args.h"
#include "cli/commands.h"
#include "cli/engine.h"
#include "core/error.h"
#include "dist/group.h"
#include "io/safetensors.h"
#include "model/model.h"

namespace k3::cli {

void register_logits(CLI::App& app) {
  struct Opts {
    std::string model, out;
    std::vector<std::string> ids;
    DeviceOptions device;
  };
  auto o = std::make_shared<Opts>();
  CLI::App* sub =
      app.add_subcommand("logits",
                         "Run the full forward pass over rows of token ids and write the logits.\n"
                         "Reads MODEL/config.json and its safetensors; writes OUT, a safetensors file with one F32\n"
                         "tensor 'logits' of shape [B, T, V] (B = number of --ids, all of the same length T).");
  sub->add_option("--model", o->model, "model directory (config.json + model.safetensors or shards)")->required();
  sub->add_option("--ids", o->ids, "comma-separated token ids of one row; repeat for more rows")->required();
  sub->add_option("--out", o->out, "output .safetensors path (written atomically)")->required();
  add_device_options(sub, o->device);
  sub->callback([o] {
    std::vector<std::vector<int32_t>> rows;
    for (const auto& s : o->ids) rows.push_back(parse_ids(s, "--ids"));
    for (size_t b = 1; b < rows.size(); ++b)
      if (rows[b].size() != rows[0].size())
        fail("--ids: all rows must have the same length (row 0 has ", rows[0].size(), " ids, row ", b, " has ",
             rows[b].size(), ")");
    check_output_path(o->out);
    std::unique_ptr<Engine> engine = load_engine(o->model, o->device);
    Engine& m = *engine;
    check_ids_in_vocab(rows, m.config().vocab_size, "--ids", m.config().source);
    check_output_path(o->out);  // again, now that the model's files are known inputs
    const int64_t B = int64_t(rows.size()), T = int64_t(rows[0].size()), V = m.config().vocab_size;
    std::fprintf(stderr, "[%.2fs] forward on %s: %lld row(s) x %lld tokens\n", elapsed_seconds(),
                 m.description().c_str(), (long long)B, (long long)T);
    std::vector<float> logits = m.forward_fresh(rows);
    if (!dist::lead_rank()) return;  // expert-parallel ranks hold the same logits; rank 0 writes them
    write_safetensors(o->out, {{"logits", DType::F32, {B, T, V}, logits.data()}});
    std::fprintf(stderr, "[%.2fs] wrote %s: logits [%lld, %lld, %lld]\n", elapsed_seconds(), o->out.c_str(),
                 (long long)B, (long long)T, (long long)V);
  });
}

}  // namespace k3::cli
